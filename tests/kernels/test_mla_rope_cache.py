"""The MLA step between projections and attention in one kernel (kernels/mla_rope_cache.py) against its torch
reference (the engine's torch form: RMSNorm of the latent, interleaved rope of q_pe and k_pe, the KV-cache
row written at each token's slot).

CPU: Triton interpreter; on a GPU the same tests at DeepSeek-V3's shapes run too. Random inputs (never zeros):
q as a strided view of a projection's output (as the engine passes it), the latent a column slice of a wider
buffer (the merged q_a / kv_a GEMM's output), positions out of order and past the first table rows, slots
scattered over a cache filled with random rows (rows not written must keep them), bf16 / fp32 caches and an
FP8 cache with a scale (values beyond +-448 saturate). Outputs start as NaN (`poison`).

- q_pe and k_pe are bit-equal to the reference (the rotation is two float32 products and a sum, rounded once,
  compiled without fused multiply-adds);
- c_kv is bit-equal to the RMSNorm kernel (kernels/rms_norm.py: the same tile, the same sums) and within its
  tolerance of the torch reference;
- the written cache rows are the kernel's own [c_kv, k_pe] cast as KVPool.write casts them.
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.config import RopeConfig
from engine.model.rope import RotaryEmbedding
from kernels.fp8_math import FP8_DTYPE
from kernels.mla_rope_cache import mla_rope_cache, mla_rope_cache_ref, supported
from kernels.rms_norm import rms_norm_ref, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_SHAPES = [  # tokens, heads, nope, rope, kv_lora
    (1, 4, 32, 16, 64),
    (5, 3, 16, 8, 96),
    (9, 16, 128, 64, 512),
]
GPU_SHAPES = [(1, 128, 128, 64, 512), (7, 16, 128, 64, 512), (300, 128, 128, 64, 512), (257, 32, 128, 64, 512)]
YARN = RopeConfig(kind="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                  beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def _case(tokens, heads, nope, rope, kv_lora, dtype, cache_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qk = nope + rope
    proj = torch.randn(tokens, heads * qk + 24, generator=g).to(dtype)  # q rows inside a wider projection
    q = proj.to(DEVICE)[:, 8:8 + heads * qk].view(tokens, heads, qk)
    wide = (3 * torch.randn(tokens, 40 + kv_lora + rope, generator=g)).to(dtype)  # q_a columns before it
    latent = wide.to(DEVICE)[:, 40:]
    weight = (1 + 0.3 * torch.randn(kv_lora, generator=g)).to(dtype).to(DEVICE)
    table = RotaryEmbedding(YARN, rope, 4096, torch.device(DEVICE))
    positions = torch.randperm(4096, generator=g)[:tokens].to(DEVICE)
    slots = (torch.randperm(3 * tokens + 5, generator=g)[:tokens] + 1).to(DEVICE)
    cache = (2 * torch.randn(3 * tokens + 6, kv_lora + rope, generator=g)).to(cache_dtype).to(DEVICE)
    return q, latent, weight, table, positions, slots, cache


def _run(fn, q, latent, weight, table, positions, slots, cache, kv_scale, write=True):
    return fn(q, latent, weight, 1e-6, table.cos, table.sin, positions, weight.shape[0],
              cache if write else None, slots if write else None, kv_scale)


def _check(shape, dtype, cache_dtype, kv_scale, write=True):
    q, latent, weight, table, positions, slots, cache = _case(*shape, dtype, cache_dtype, seed=sum(shape))
    cache_ref = cache.clone()
    q_pe, c_kv, k_pe = _run(mla_rope_cache, q, latent, weight, table, positions, slots, cache, kv_scale, write)
    r_q, r_c, r_k = _run(mla_rope_cache_ref, q, latent, weight, table, positions, slots, cache_ref, kv_scale, write)
    assert q_pe.is_contiguous() and q_pe.shape == r_q.shape and q_pe.dtype == r_q.dtype
    assert torch.equal(q_pe, r_q), (q_pe - r_q).abs().max()
    assert torch.equal(k_pe, r_k), (k_pe - r_k).abs().max()
    kv_lora = weight.shape[0]
    assert torch.equal(c_kv, rms_norm_triton(latent[:, :kv_lora], weight, 1e-6))
    torch.testing.assert_close(c_kv.float(), r_c.float(), rtol=2.0**-6 if dtype != torch.float32 else 2.0**-20,
                               atol=1e-5)
    if not write:
        return
    row = torch.cat((c_kv, k_pe), dim=-1)
    if cache.dtype != row.dtype:
        row = (row.float() / kv_scale).to(cache.dtype)
    written = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    written[slots] = True
    as_bytes = (lambda t: t.view(torch.uint8)) if cache.dtype.itemsize == 1 else (lambda t: t)
    assert torch.equal(as_bytes(cache[slots]), as_bytes(row))
    assert torch.equal(as_bytes(cache[~written]), as_bytes(cache_ref[~written]))  # nothing else touched


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("dtype,cache_dtype,kv_scale", [
    (torch.bfloat16, torch.bfloat16, 1.0), (torch.float32, torch.float32, 1.0), (torch.bfloat16, FP8_DTYPE, 0.05)],
    ids=["bf16", "fp32", "bf16-fp8cache"])
def test_matches_reference(poison, shape, dtype, cache_dtype, kv_scale):
    _check(shape, dtype, cache_dtype, kv_scale)


def test_without_cache_write(poison):
    """--disable-mla keeps no latent cache: the kernel then only normalises and rotates."""
    _check(CPU_SHAPES[0], torch.bfloat16, torch.bfloat16, 1.0, write=False)


def test_no_tokens_and_unsupported_inputs():
    q, latent, weight, table, positions, slots, cache = _case(0, 4, 32, 16, 64, torch.bfloat16, torch.bfloat16)
    q_pe, c_kv, k_pe = _run(mla_rope_cache, q, latent, weight, table, positions, slots, cache, 1.0)
    assert q_pe.shape == (0, 4, 16) and c_kv.shape == (0, 64) and k_pe.shape == (0, 16)
    assert not supported(q, latent, weight, 63)  # a norm weight that is not the latent's width
    assert not supported(q.transpose(1, 2), latent, weight, 64)  # last dimension strided


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSeek-V3 shapes need a CUDA GPU")
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("cache_dtype,kv_scale", [(torch.bfloat16, 1.0), (FP8_DTYPE, 1.0), (FP8_DTYPE, 0.03)])
def test_deepseek_shapes_on_gpu(poison, shape, cache_dtype, kv_scale):
    _check(shape, torch.bfloat16, cache_dtype, kv_scale)


def test_reference_is_the_engine_rope():
    """The reference's rotation is engine/model/rope.py's (what the torch path of the engine runs)."""
    q, latent, weight, table, positions, slots, cache = _case(3, 2, 8, 16, 32, torch.float32, torch.float32)
    r_q, r_c, r_k = _run(mla_rope_cache_ref, q, latent, weight, table, positions, slots, cache, 1.0)
    assert torch.equal(r_q, table.apply(q[..., 8:], positions))
    assert torch.equal(r_k, table.apply(latent[:, 32:], positions))
    assert torch.equal(r_c, rms_norm_ref(latent[:, :32], weight, 1e-6))
