"""Built-in synthetic checkpoints (`tiny`, `tiny-fp8`, `tiny-fp8-tp`) written in the exact HF layout.

The weights are drawn from numpy's PCG64 with a fixed seed, so every machine
materialises byte-identical files: sharded safetensors + model.safetensors.index.json,
config.json, a byte-level tokenizer.json and a tokenizer_config.json with a
DeepSeek-style chat template. `tiny-fp8` is the same model with its linear
weights stored as 128x128 block FP8 + weight_scale_inv. `tiny-fp8-tp` is a block-FP8
model shaped so that its TP 2 and TP 4 slices are whole 128 x 128 blocks (128-row heads,
o_proj / MLP / expert intermediate dims of 512 or more), so it stays FP8 under TP (see
docs/parallelism.md, "FP8 blocks"); `tiny-fp8` at TP 2 / 4 does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from engine.checkpoint.cache import build_once, cache_root
from engine.checkpoint.config import ModelConfig, parse_config
from engine.checkpoint.tiny_tokenizer import write_tokenizer
from kernels.fp8_math import quantize_block_fp8

FORMAT_VERSION = 1
SEED = 1234
NUM_SHARDS = 3


def hf_state_dict(cfg: ModelConfig, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Random weights for cfg in the HF DeepSeek naming (with the MTP layer if configured)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    sd: dict[str, torch.Tensor] = {}

    def lin(name: str, out_f: int, in_f: int) -> None:
        sd[name] = torch.from_numpy(rng.standard_normal((out_f, in_f), dtype=np.float32) / np.sqrt(in_f))

    def norm(name: str, dim: int) -> None:
        sd[name] = torch.from_numpy(1 + 0.1 * rng.standard_normal(dim, dtype=np.float32))

    h, heads = cfg.hidden_size, cfg.num_attention_heads
    sd["model.embed_tokens.weight"] = torch.from_numpy(rng.standard_normal((cfg.vocab_size, h), dtype=np.float32))
    layers = cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
    for i in range(layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        a = p + "self_attn."
        if cfg.q_lora_rank:
            lin(a + "q_a_proj.weight", cfg.q_lora_rank, h)
            norm(a + "q_a_layernorm.weight", cfg.q_lora_rank)
            lin(a + "q_b_proj.weight", heads * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            lin(a + "q_proj.weight", heads * cfg.qk_head_dim, h)
        lin(a + "kv_a_proj_with_mqa.weight", cfg.kv_cache_dim, h)
        norm(a + "kv_a_layernorm.weight", cfg.kv_lora_rank)
        lin(a + "kv_b_proj.weight", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        lin(a + "o_proj.weight", h, heads * cfg.v_head_dim)
        if cfg.is_moe_layer(i):
            n = cfg.moe_intermediate_size
            lin(p + "mlp.gate.weight", cfg.n_routed_experts, h)
            if cfg.topk_method == "noaux_tc":
                sd[p + "mlp.gate.e_score_correction_bias"] = torch.from_numpy(
                    0.05 * rng.standard_normal(cfg.n_routed_experts, dtype=np.float32))
            for e in range(cfg.n_routed_experts):
                _mlp(lin, f"{p}mlp.experts.{e}.", h, n)
            if cfg.n_shared_experts:
                _mlp(lin, p + "mlp.shared_experts.", h, n * cfg.n_shared_experts)
        else:
            _mlp(lin, p + "mlp.", h, cfg.intermediate_size)
        if i == cfg.num_hidden_layers:  # the MTP / NextN module's own tensors
            norm(p + "enorm.weight", h)
            norm(p + "hnorm.weight", h)
            lin(p + "eh_proj.weight", h, 2 * h)
            norm(p + "shared_head.norm.weight", h)
            sd[p + "shared_head.head.weight"] = sd.setdefault("lm_head.weight", _head(rng, cfg)).clone()
            sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    norm("model.norm.weight", h)
    sd.setdefault("lm_head.weight", _head(rng, cfg))
    return sd


def _head(rng, cfg: ModelConfig) -> torch.Tensor:
    h = cfg.hidden_size
    return torch.from_numpy(rng.standard_normal((cfg.vocab_size, h), dtype=np.float32) / np.sqrt(h))


def _mlp(lin, prefix: str, h: int, inter: int) -> None:
    lin(prefix + "gate_proj.weight", inter, h)
    lin(prefix + "up_proj.weight", inter, h)
    lin(prefix + "down_proj.weight", h, inter)


def quantize_state_dict(sd: dict[str, torch.Tensor], block=(128, 128)) -> dict[str, torch.Tensor]:
    """Store every *_proj linear weight as block FP8 + weight_scale_inv (norms, embeddings, gate stay)."""
    out = {}
    for name, w in sd.items():
        if name.endswith("_proj.weight"):
            q, s = quantize_block_fp8(w, block)
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, s
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def write_checkpoint(directory: Path, config: dict, sd: dict[str, torch.Tensor], num_shards: int = NUM_SHARDS) -> None:
    """Write sd as HF-style sharded safetensors + index + config.json into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(sd)
    per = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        chunk = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: sd[n].contiguous() for n in chunk}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
        total += sum(sd[n].numel() * sd[n].element_size() for n in chunk)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def materialize(alias: str, config: dict) -> Path:
    """Path of the built-in checkpoint `alias`, writing it on first use (atomically)."""
    def write(tmp: Path) -> None:
        cfg = parse_config(config)
        sd = hf_state_dict(cfg)
        sd = quantize_state_dict(sd) if cfg.fp8 else {k: v.to(torch.bfloat16) for k, v in sd.items()}
        write_checkpoint(tmp, config, sd)
        write_tokenizer(tmp, cfg)

    return build_once(cache_root() / "models" / f"{alias}-v{FORMAT_VERSION}", write)
