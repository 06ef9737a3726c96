"""FP8 q.k dots in MLA decode ("fp8dot", the default for e4m3 caches at 128 heads) on the GPU.

The kernel quantises the queries to e4m3 per row: that must cost about as much accuracy as the
"split" mode it replaces (which upcasts the cache and keeps 16-bit queries), measured against the
unquantised bf16 cache, at DeepSeek-V3's shapes and in a model run (dummy V3 weights, 128 heads).
Skipped without a CUDA GPU of compute capability 8.9+ (FP8 dots).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kernels.mla_decode as mla
from engine.engine import Engine
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 dots (sm_89+)")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _deepseek_case(seq_lens, heads=128, lkv=512, rope=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_ctx = max(seq_lens) + 1
    slots = len(seq_lens) * max_ctx + 1
    table = (torch.randperm(slots - 1, device="cuda", generator=g) + 1).to(torch.int32).view(len(seq_lens), -1)
    cache = torch.randn(slots, lkv + rope, device="cuda", generator=g).bfloat16()
    q = (torch.randn(len(seq_lens), heads, lkv, device="cuda", generator=g) * 0.5).bfloat16()
    q_pe = (torch.randn(len(seq_lens), heads, rope, device="cuda", generator=g) * 0.5).bfloat16()
    rows = torch.arange(len(seq_lens), device="cuda")
    lens = torch.tensor(seq_lens, device="cuda")
    return q, q_pe, cache, table, rows, lens


def test_default_for_e4m3_at_128_heads():
    assert mla.default_config(128, torch.float8_e4m3fn).kv_load == "fp8dot"
    assert mla.default_config(128, torch.float8_e5m2).kv_load == "split"
    assert mla.default_config(16, torch.float8_e4m3fn).kv_load == "split"  # no FP8 wgmma below 64 rows


def test_fp8dot_error_at_deepseek_shapes_is_like_split():
    q, q_pe, cache, table, rows, lens = _deepseek_case([1, 37, 300, 1024, 2500, 4001])
    sm_scale = 192 ** -0.5
    scale = cache.float().abs().amax().item() / 448.0
    kv8 = (cache.float() / scale).to(torch.float8_e4m3fn)
    ref = mla.mla_decode_ref(q, q_pe, cache, table, rows, lens, sm_scale)  # unquantised cache and queries
    cfg = mla.default_config(128, torch.float8_e4m3fn)
    fp8dot = mla.mla_decode(q, q_pe, kv8, table, rows, lens, sm_scale, kv_scale=scale, config=cfg)
    split = mla.mla_decode(q, q_pe, kv8, table, rows, lens, sm_scale, kv_scale=scale,
                           config=replace(cfg, kv_load="split", fp16_math=False))
    bf16 = mla.mla_decode(q, q_pe, cache, table, rows, lens, sm_scale)
    e_dot, e_split, e_bf16 = _rel(fp8dot, ref), _rel(split, ref), _rel(bf16, ref)
    print(f"rel err vs unquantised: fp8dot {e_dot:.3e}, split {e_split:.3e}, bf16 cache {e_bf16:.3e}")
    assert e_bf16 < 1e-2
    assert e_dot < 1.5 * e_split and e_dot < 0.1


def _teacher_logprobs(**kw) -> torch.Tensor:
    """Prompt log-probs of one 300-token prompt prefilled in chunks of 8: every chunk after the first
    extends a cached prefix by <= 16 tokens, which the latent decode kernel serves (plan_extend)."""
    eng = Engine(model="deepseek-v3", load_format="dummy", num_layers=2, device="cuda", max_total_tokens=8192,
                 max_model_len=1024, cuda_graph_bs="1,2", chunked_prefill_size=8, **kw)
    ids = torch.randint(3, 32000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    out = eng.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=1, temperature=0,
                                                                        prompt_logprobs=True))[0]
    del eng
    torch.cuda.empty_cache()
    return torch.tensor(out.prompt_logprobs[9:])  # the first chunk attends without the decode kernel


def test_fp8dot_in_a_model_run_is_as_close_to_bf16_kv_as_split(monkeypatch):
    ref = _teacher_logprobs()
    dot = _teacher_logprobs(kv_cache_dtype="fp8_e4m3")
    default = mla.default_config
    monkeypatch.setattr(mla, "default_config", lambda rows, dtype: replace(default(rows, dtype), kv_load="split",
                                                                           fp16_math=False))
    split = _teacher_logprobs(kv_cache_dtype="fp8_e4m3")
    d_dot, d_split = (dot - ref).abs().mean().item(), (split - ref).abs().mean().item()
    print(f"mean |dlogp| vs bf16 KV over {ref.numel()} positions: fp8dot {d_dot:.4f}, split {d_split:.4f}")
    assert not torch.equal(dot, split)  # the two runs took different kernels
    assert d_dot < 1.5 * d_split + 0.01
