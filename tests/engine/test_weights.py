"""Checkpoint loading: built-in tiny models, FP8 blocks, dummy weights, absorption, real shapes."""

import hashlib

import pytest
import torch

from engine.checkpoint import tiny
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.engine import Engine
from engine.errors import CheckpointError
from engine.model.deepseek import DeepseekForCausalLM, MTPLayer
from engine.sampling import SamplingParams
from kernels.fp8_math import dequant_block_fp8, quantize_block_fp8


def _digest(directory):
    h = hashlib.sha256()
    for f in sorted(directory.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_tiny_is_deterministic_and_hf_layout(tmp_path, monkeypatch):
    paths = []
    for sub in ("a", "b"):
        monkeypatch.setenv("DSCTL_CACHE_DIR", str(tmp_path / sub))
        paths.append(tiny.materialize("tiny", lookup("tiny").config_dict()))
    assert _digest(paths[0]) == _digest(paths[1])
    names = {f.name for f in paths[0].iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) == tiny.NUM_SHARDS


def test_block_fp8_roundtrip_error_is_quantisation_sized():
    w = torch.randn(300, 200, dtype=torch.float64)
    q, s = quantize_block_fp8(w.float())
    assert s.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    back = dequant_block_fp8(q, s, (128, 128), torch.float64)
    rel = (back - w).norm() / w.norm()
    assert 1e-4 < rel < 4e-2  # e4m3 has a 3-bit mantissa: ~2-3% worst case, never exact


def test_tiny_fp8_close_to_tiny():
    ids = list(range(40, 90))
    sp = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
    a = Engine(model="tiny", device="cpu").generate(input_ids=[ids], sampling_params=sp)[0]
    b = Engine(model="tiny-fp8", device="cpu").generate(input_ids=[ids], sampling_params=sp)[0]
    da = torch.tensor(a.prompt_logprobs[1:])
    db = torch.tensor(b.prompt_logprobs[1:])
    assert 0 < (da - db).abs().max() < 0.5


def test_absorbed_weights_are_kv_b_proj_per_head():
    eng = Engine(model="tiny", device="cpu")
    attn = eng.runner.model.layers[0].self_attn
    w = attn.kv_b_proj.weight.view(attn.num_heads, attn.nope + attn.v_dim, attn.kv_lora_rank)
    torch.testing.assert_close(attn.w_kc, w[:, :attn.nope])
    torch.testing.assert_close(attn.w_vc, w[:, attn.nope:])


def test_missing_shard_lists_missing_files(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("DSCTL_CACHE_DIR", str(tmp_path / "cache"))
    src = tiny.materialize("tiny", lookup("tiny").config_dict())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        Engine(model=str(ckpt), device="cpu")


def test_dummy_weights_run_and_are_seeded():
    ids = [[5, 6, 7, 8]]
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    a = Engine(model="tiny", load_format="dummy", seed=3, device="cpu").generate(input_ids=ids, sampling_params=sp)[0]
    b = Engine(model="tiny", load_format="dummy", seed=3, device="cpu").generate(input_ids=ids, sampling_params=sp)[0]
    c = Engine(model="tiny", load_format="dummy", seed=4, device="cpu").generate(input_ids=ids, sampling_params=sp)[0]
    assert a.logprobs == b.logprobs and a.logprobs != c.logprobs


def test_num_layers_override():
    eng = Engine(model="tiny", num_layers=2, device="cpu")
    assert len(eng.runner.model.layers) == 2 and eng.runner.mtp is not None
    assert len(eng.runner.kv_pool.buffer) == 3  # 2 layers + the MTP layer's cache


def test_deepseek_v3_real_shapes_count_671b():
    """Built on the meta device: the real V3 layout (FP8 linears on the W8A8 path) has ~671B + ~14B MTP params."""
    cfg = parse_config(lookup("deepseek-v3").config_dict())
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, torch.bfloat16, (128, 128))
        mtp = MTPLayer(cfg, cfg.num_hidden_layers, torch.bfloat16, (128, 128))

    def count(m):
        return sum(p.numel() for n, p in m.named_parameters() if "scale" not in n)

    assert 670e9 < count(model) < 672e9
    assert 11e9 < count(mtp) < 12e9  # its own layer + eh_proj; embedding/head are shared (+1.85B if stored)
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert "layers.3.mlp.w13" in fp8 and "layers.0.self_attn.q_a_proj.weight" in fp8
    assert model.lm_head.dtype == torch.bfloat16 and model.layers[3].mlp.gate_weight.dtype == torch.float32  # router
