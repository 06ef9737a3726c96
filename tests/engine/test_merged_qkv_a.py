"""MLA.merge_qkv_a (q_a_proj and kv_a_proj_with_mqa as one GEMM) and the RMSNorm fused with the FP8
quantisation of the GEMM it feeds (RMSNorm.for_linear, kernels.norm_quant), and SwiGLU's SiLU(gate) * up fused
with the down projection's quantisation (MLP.activation, kernels.act_quant), against the paths they replace.

- One MLA layer: the merged projection gives the q and latent the two projections gave (plain and block-FP8
  weights, torch and Triton GEMMs); the merged FP8 scale rows are q_a's then kv_a's (kv_a's last block partial,
  as V3's 576 rows); q_a rows that are not whole scale blocks stay apart; V2-Lite (no q_lora_rank) keeps q_proj.
- The norm feeding a block-FP8 linear hands it the quantised pair when `norm_quant` is set, which gives the
  GEMM output the unfused norm + GEMM gives; without FP8 linears (or norm_quant off) it is the plain norm.
- With the engine's Triton kernels (the RMSNorm, the fused norm + quantisation, the block-FP8 GEMM; under the
  interpreter on CPU), bf16 and float32: a layer input's q, latent and normalised c_kv through the merged
  GEMM and the fused norm are bit-equal to those through the norm, its quantisation and the two GEMMs.
- A W8A8 model (tiny-fp8, two layers, FP8 weights kept, the W8A8 maths in torch) in float32: greedy
  tokens of a prefill and decode steps with both new paths equal those of the old paths (merge off, norm_quant
  off), logits within float32 noise. The TP 2 / 4 comparison with the old paths is
  tests/distributed/test_model_tp.py's (its one-process references run the old paths).
- On a GPU (marked gpu), the engine with and without both new paths: the same greedy tokens (every value is
  bit-equal, see the GPU test's docstring).
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.model import act_ops, fp8_ops, norm_ops
from engine.model.attention import MLA
from engine.model.kernel_set import REFERENCE
from engine.model.layers import FP8Input, Linear, RMSNorm
from kernels.fp8 import block_fp8_matmul_ref
from kernels.fp8_math import dequant_block_fp8, quantize_block_fp8

BLOCK = (128, 128)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels on CPU tensors (the interpreter); "
                              "on a GPU the gpu-marked test below runs them")
FUSED = replace(REFERENCE, gemm=fp8_ops.triton_linear, norm_quant=norm_ops.triton_norm_quant,
                gemm_q=fp8_ops.triton_linear_q)
OLD_TRITON = replace(REFERENCE, gemm=fp8_ops.triton_linear, rms_norm=norm_ops.triton_rms_norm)  # the engine's, off
NEW_TRITON = replace(OLD_TRITON, norm_quant=norm_ops.triton_norm_quant, gemm_q=fp8_ops.triton_linear_q)


def _cfg(alias="tiny-fp8", **changes):
    return replace(parse_config(lookup(alias).config_dict()), **changes)


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, Linear):
            w = 0.05 * torch.randn(m.out_features, m.in_features, generator=g)
            if m.fp8_block:
                q, s = quantize_block_fp8(w, m.fp8_block)
                m.weight.data.copy_(q)
                m.weight_scale_inv.data.copy_(s)
            else:
                m.weight.data.copy_(w)
        elif isinstance(m, RMSNorm):
            m.weight.data.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))


@pytest.mark.parametrize("fp8,gemm", [(False, None), (True, fp8_ops.torch_linear),
                                     pytest.param(True, fp8_ops.triton_linear, marks=cpu_only)],
                         ids=["fp32", "fp8-torch", "fp8-triton"])
def test_merged_projection_equals_the_two(fp8, gemm):
    cfg = _cfg()  # q_lora 128 (one block), kv_a 128 + 32 = 160 rows (one and a quarter blocks)
    kernels = replace(REFERENCE, gemm=gemm) if gemm else REFERENCE
    mla = MLA(cfg, 0, torch.float32, BLOCK if fp8 else None, kernels=kernels)
    _fill(mla, 0)
    q_a, kv_a = mla.q_a_proj, mla.kv_a_proj_with_mqa
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    q_before, latent_before = mla.project(x)
    mla.merge_qkv_a()
    merged = mla.qkv_a_proj
    assert merged is not None and not hasattr(mla, "q_a_proj") and not hasattr(mla, "kv_a_proj_with_mqa")
    assert mla.input_linears() == (merged,) and merged.kernels is kernels
    assert merged.weight.shape == (128 + 160, cfg.hidden_size)
    assert torch.equal(merged.weight[:128].float(), q_a.weight.float())
    assert torch.equal(merged.weight[128:].float(), kv_a.weight.float())
    if fp8:
        assert merged.weight.dtype == torch.float8_e4m3fn and merged.weight_scale_inv.shape == (3, 2)
        # every 128-row block of the merged weight has its own scale row: dequantised, the two weights stacked
        whole = dequant_block_fp8(merged.weight, merged.weight_scale_inv, BLOCK)
        parts = torch.cat([dequant_block_fp8(lin.weight, lin.weight_scale_inv, BLOCK) for lin in (q_a, kv_a)])
        assert torch.equal(whole, parts)
    q_after, latent_after = mla.project(x)
    assert q_before.abs().max() > 1e-3 and latent_before.abs().max() > 1e-3
    torch.testing.assert_close(q_after, q_before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(latent_after, latent_before, rtol=1e-5, atol=1e-6)


def test_v3_merged_shapes_on_meta():
    """DeepSeek-V3: N = 1536 + 576 = 2112 rows, scale rows 12 + 5 = 17 (kv_a's fifth covers its last 64 rows)."""
    cfg = _cfg("deepseek-v3")
    with torch.device("meta"):
        mla = MLA(cfg, 0, torch.bfloat16, BLOCK)
        assert mla.kv_a_proj_with_mqa.weight_scale_inv.shape == (5, 56)
        mla.merge_qkv_a()
    assert mla.qkv_a_proj.weight.shape == (2112, 7168) and mla.qkv_a_proj.weight_scale_inv.shape == (17, 56)


def test_unaligned_or_absent_q_a_stays_apart():
    mla = MLA(_cfg(q_lora_rank=192), 0, torch.float32, BLOCK)  # 192 rows: a scale block would straddle q_a / kv_a
    mla.merge_qkv_a()
    assert mla.qkv_a_proj is None and mla.input_linears() == (mla.q_a_proj, mla.kv_a_proj_with_mqa)
    lite = MLA(_cfg(q_lora_rank=None), 0, torch.float32, None)  # V2-Lite: q_proj, split by heads under TP
    lite.merge_qkv_a()
    assert lite.qkv_a_proj is None and lite.input_linears() == (lite.q_proj, lite.kv_a_proj_with_mqa)


@cpu_only
def test_norm_for_fp8_linears_hands_them_the_quantised_pair():
    norm = RMSNorm(256, 1e-6, torch.float32, FUSED)
    lin = Linear(256, 288, torch.float32, BLOCK, FUSED)
    _fill(norm, 2)
    _fill(lin, 3)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)) * 3
    h = norm.for_linear(x, lin)
    assert isinstance(h, FP8Input) and h.dtype == torch.float32 and h.shape == (4, 256)
    want = fp8_ops.triton_linear(norm(x), lin.weight, lin.weight_scale_inv, BLOCK)
    assert want.abs().max() > 1e-2
    torch.testing.assert_close(lin(h), want, rtol=1e-5, atol=1e-5)
    plain = Linear(256, 64, torch.float32, None, FUSED)
    assert isinstance(norm.for_linear(x, lin, plain), torch.Tensor)  # a plain linear reads it too: the norm
    off = RMSNorm(256, 1e-6, torch.float32, REFERENCE)
    off.weight.data.copy_(norm.weight)
    assert torch.equal(off.for_linear(x, lin), norm(x))  # norm_quant off: the norm as before


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test on CPU tensors")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_paths_bit_equal(dtype):
    """Layer input -> (q, latent, normalised c_kv): input norm + quantisation fused and q_a / kv_a merged (q_a read
    in place from the merged output, its norm fused too) against the RMSNorm kernel, the GEMMs' quantisation and
    two GEMMs: the same bits (the Triton GEMM's tile config depends on M, K only, never on N)."""
    cfg = _cfg()
    x = (3 * torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(5))).to(dtype)
    outs = []
    for kernels, merge in ((OLD_TRITON, False), (NEW_TRITON, True)):
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        mla = MLA(cfg, 0, dtype, BLOCK, kernels=kernels)
        _fill(norm, 6)
        _fill(mla, 7)
        if merge:
            mla.merge_qkv_a()
        h = norm.for_linear(x, *mla.input_linears())
        assert isinstance(h, FP8Input) == merge and (mla.qkv_a_proj is not None) == merge
        q, latent = mla.project(h)
        outs.append((q, latent, mla.kv_a_layernorm(latent[:, :cfg.kv_lora_rank])))
    for new, old in zip(*outs):
        assert new.dtype == dtype and old.abs().max() > 1e-2
        assert torch.equal(new, old), (new.float() - old.float()).abs().max()


# ---------------------------------------------------------------------------- a W8A8 model, old paths vs new


def _run_model(new_paths: bool) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens and logits of a prefill of two prompts and three decode steps, tiny-fp8 with 2 layers
    (one dense, one MoE), FP8 weights kept, the W8A8 maths in plain torch (block_fp8_matmul_ref; new paths: the
    norm + quantisation reference and the GEMM of a quantised input; the Triton kernels are checked above and
    in tests/kernels/test_fused_norm_quant.py, the interpreter being too slow for a whole model here)."""
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.memory.pools import KVPool, ReqToTokenPool
    from engine.model.attention import TorchAttentionBackend
    from engine.model.builder import build_model
    from engine.model.context import ForwardContext
    from engine.model.moe import TorchMoEBackend
    from engine.model.rope import RotaryEmbedding

    cfg = _cfg()
    quantised_inputs = []

    def gemm_q(*args):
        quantised_inputs.append(args[0].shape)
        return fp8_ops.torch_linear_q(*args)

    kernels = replace(REFERENCE, gemm=block_fp8_matmul_ref)
    if new_paths:
        kernels = replace(kernels, norm_quant=norm_ops.torch_norm_quant, act_quant=act_ops.torch_act_quant,
                          add_norm_quant=norm_ops.torch_add_norm_quant, gemm_q=gemm_q)
    with mock.patch.object(MLA, "merge_qkv_a", MLA.merge_qkv_a if new_paths else lambda self: None):
        model, _ = build_model(cfg, 2, torch.float32, "cpu", BLOCK, seed=3, mtp=False, kernels=kernels)
    assert (model.layers[0].self_attn.qkv_a_proj is not None) == new_paths
    kv = KVPool(2, 64, cfg.kv_cache_dim, torch.float32, torch.device("cpu"))
    table = ReqToTokenPool(2, 32, torch.device("cpu"))
    ctx = ForwardContext(kv, table, RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, 64, torch.device("cpu")),
                         TorchAttentionBackend(), TorchMoEBackend())
    prompts = [[5, 61, 7, 200, 9], [20, 121, 22]]
    rows = [table.alloc() for _ in prompts]
    lens, logits_all = [len(p) for p in prompts], []

    def step(mode, ids, prefixes, extend, logits_rows):
        slots = [kv.alloc(n) for n in extend]
        for row, p, s in zip(rows, prefixes, slots):
            table.set(row, p, s)
        fb = ForwardBatch.build(mode, ids, rows, prefixes, extend, torch.cat(slots), logits_rows,
                                torch.device("cpu"))
        ctx.begin_forward(fb)
        with torch.inference_mode():
            logits = model.logits(model.hidden_states(fb, ctx)[fb.logits_indices])
        logits_all.append(logits)
        return logits.argmax(-1).tolist()

    tokens = [step(ForwardMode.EXTEND, prompts[0] + prompts[1], [0, 0], lens, [lens[0] - 1, sum(lens) - 1])]
    for _ in range(3):
        tokens.append(step(ForwardMode.DECODE, tokens[-1], lens, [1, 1], [0, 1]))
        lens = [n + 1 for n in lens]
    return tokens, logits_all, len(quantised_inputs)


def test_w8a8_model_greedy_tokens_equal_the_old_paths():
    new_tokens, new_logits, fused = _run_model(True)
    old_tokens, old_logits, unfused = _run_model(False)
    # per forward: qkv_a, q_b of both layers and the dense layer's gate_up read a norm's quantised output, the
    # dense MLP's and the shared experts' down projections SiLU(gate) * up quantised with it (act_quant)
    assert (fused, unfused) == (4 * 7, 0)
    assert new_tokens == old_tokens
    for new, old in zip(new_logits, old_logits):
        assert old.abs().max() > 0.1
        torch.testing.assert_close(new, old, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_greedy_tokens_equal_the_old_paths():
    """tiny-fp8 on the GPU (FP8 weights kept, Triton / cuBLASLt GEMMs, CUDA graphs), bf16 (float32 activations
    are not fused on a GPU: engine/model/norm_ops.py): the same greedy tokens with the merged q_a / kv_a GEMM and
    the fused norm + quantisation as without them. Exactly, as every value is bit-equal: the fused kernel runs
    the RMSNorm kernel's tile and warps and rounds to bf16 as it does (tests/kernels/test_fused_norm_quant.py's
    GPU test) and then the group quantisation's operations; the
    merged GEMM (N = 288) runs the Triton kernel with the config of the separate ones (N = 128, 160): no tuned
    file for these N, so all take the default, which depends on M only; K = 256 keeps cuBLASLt off. An output
    element's sums do not depend on N. (At V3's shapes the tuned configs and cuBLASLt's choices differ by N,
    so there the merged GEMM agrees to float32 rounding only.)"""
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 3)]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    def tokens(**kw):
        eng = Engine(model="tiny-fp8", device="cuda", dtype="bfloat16", max_total_tokens=4096, **kw)
        assert eng.runner.kernel_choice.norm_quant == kw.get("norm_quant_backend", "triton")
        assert eng.runner.kernel_choice.act_quant == kw.get("act_quant_backend", "triton")
        out = [o.token_ids for o in eng.generate(input_ids=prompts, sampling_params=params)]
        eng.close()
        return out

    new = tokens()
    with mock.patch.object(MLA, "merge_qkv_a", lambda self: None):
        old = tokens(norm_quant_backend="off", act_quant_backend="off")
    assert new == old
