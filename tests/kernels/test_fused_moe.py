"""moe_align_block_size and fused_moe vs their torch references (CPU: Triton interpreter).

Sizes are deliberately awkward: K and N not multiples of the blocks (N = 72 puts the
first up row in the middle of a 128-row scale block), E = 5 / 9 / 300, empty batches,
EP-style ids (-1) that must contribute nothing. Outputs and every internal buffer
start as NaN (torch.empty is poisoned), so unwritten rows that were read would show.
"""

import pytest
import torch

from kernels.fp8_math import quantize_block_fp8
from kernels.fused_moe import fused_moe, fused_moe_ref
from kernels.moe_align import max_blocks, moe_align_block_size, moe_align_block_size_ref

# These tests hand CPU tensors to the Triton kernels, which only the interpreter (conftest.py,
# no GPU) accepts; on a GPU machine benchmarks/bench_moe_fp8.py checks every kernel at V3 shapes.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test on CPU tensors; "
                              "on a GPU run benchmarks/bench_moe_fp8.py (checks at DeepSeek-V3 shapes)")
pytestmark = cpu_only


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(t, e, top_k, seed, drop=0.0):
    """Distinct experts per token (top-k of random scores) and positive weights; `drop` of them -1."""
    g = _gen(seed)
    ids = torch.rand(t, e, generator=g).topk(top_k, dim=-1).indices.to(torch.int32)
    if drop:
        ids[torch.rand(t, top_k, generator=g) < drop] = -1
    weights = torch.rand(t, top_k, generator=g) + 0.1
    return ids, weights


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --------------------------------------------------------------------------- align


# one-program path (<= SMALL_CHUNKS chunks): (1, 1, 5), (9, 3, 7), (40, 2, 64); three-launch path: the others
@pytest.mark.parametrize("t,top_k,e,bm,chunk", [
    (1, 1, 5, 16, None), (9, 3, 7, 4, None), (33, 8, 9, 16, 16), (50, 6, 300, 16, None),
    (40, 2, 64, 32, 16), (0, 8, 256, 16, None)])
def test_moe_align_matches_ref(poison, t, top_k, e, bm, chunk):
    ids, _ = _routing(t, e, top_k, seed=t + e) if t else (torch.zeros(0, top_k, dtype=torch.int32), None)
    if t > 4:
        ids[1, 0] = ids[3, 0]  # some tokens share an expert in the same slot
    got = moe_align_block_size(ids, bm, e, chunk=chunk)
    ref = moe_align_block_size_ref(ids, bm, e)
    npp = int(ref.num_post_pad)
    assert int(got.num_post_pad) == npp
    assert got.sorted_ids.shape == ref.sorted_ids.shape == (max_blocks(t * top_k, e, bm) * bm,)
    assert torch.equal(got.sorted_ids[:npp], ref.sorted_ids[:npp])
    assert torch.equal(got.expert_ids, ref.expert_ids)
    # invariants: every assignment exactly once, in a block of its expert; padding = sentinel
    flat = ids.reshape(-1).long()
    used = got.sorted_ids[:npp].long()
    real = used[used < t * top_k]
    assert torch.equal(real.sort().values, torch.arange(t * top_k))
    owner = got.expert_ids.repeat_interleave(bm)[:npp].long()
    assert torch.equal(flat[real], owner[used < t * top_k])
    assert npp % bm == 0


def test_moe_align_skips_foreign_experts(poison):
    ids, _ = _routing(40, 40, 4, seed=5, drop=0.3)
    for chunk in (16, 64):  # three-launch and one-program paths
        got = moe_align_block_size(ids, 16, 40, chunk=chunk)
        ref = moe_align_block_size_ref(ids, 16, 40)
        npp = int(ref.num_post_pad)
        assert int(got.num_post_pad) == npp and torch.equal(got.sorted_ids[:npp], ref.sorted_ids[:npp])
        real = got.sorted_ids[:npp][got.sorted_ids[:npp] < ids.numel()].long()
        assert real.numel() == int((ids >= 0).sum())
        assert (ids.reshape(-1)[real] >= 0).all()


# --------------------------------------------------------------------------- fused MoE

CFG_A = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
CFG_B = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=4, num_warps=4, num_stages=2)
# activations quantised inside the GEMM tiles; the down GEMM with its own BLOCK_SIZE_N
CFG_Q = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
             QUANT_A=1, BLOCK_SIZE_N_DOWN=64, num_stages_DOWN=3)


def _weights(e, n, k, seed, fp8):
    g = _gen(seed)
    w13 = torch.randn(e, 2 * n, k, generator=g) / k ** 0.5
    w2 = torch.randn(e, k, n, generator=g) / n ** 0.5
    if not fp8:
        return w13, w2, None, None
    q13, s13 = quantize_block_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    return q13, q2, s13, s2


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B], ids=["A", "B"])
@pytest.mark.parametrize("t,e,top_k,n,k", [(1, 5, 1, 72, 200), (7, 9, 3, 72, 200), (33, 5, 2, 40, 136)])
def test_fused_moe_float(poison, cfg, t, e, top_k, n, k):
    x = torch.randn(t, k, generator=_gen(t))
    w13, w2, _, _ = _weights(e, n, k, seed=e, fp8=False)
    ids, weights = _routing(t, e, top_k, seed=t * e)
    out = fused_moe(x, w13, w2, ids, weights, config=cfg)
    assert out.shape == (t, k) and out.dtype == x.dtype and not out.isnan().any()
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, weights)) < 1e-5


@pytest.mark.parametrize("cfg", [CFG_A, CFG_B, CFG_Q], ids=["A", "B", "Q"])
@pytest.mark.parametrize("t,e,top_k", [(1, 5, 2), (13, 9, 3)])
def test_fused_moe_fp8(poison, cfg, t, e, top_k):
    n, k = 72, 200
    x = torch.randn(t, k, generator=_gen(t)) * torch.exp(torch.randn(t, 1, generator=_gen(t + 1)))
    q13, q2, s13, s2 = _weights(e, n, k, seed=e + 1, fp8=True)
    ids, weights = _routing(t, e, top_k, seed=t + e)
    out = fused_moe(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, config=cfg)
    assert not out.isnan().any()
    # same roundings as the kernel (activations quantised, intermediate stored in x.dtype)
    mirror = fused_moe_ref(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    assert _rel(out, mirror) < 1e-4
    # float64 of the dequantised weights with unquantised activations: the error is the
    # activation quantisation error (two e4m3 roundings, ~2**-4 / sqrt(3) rms each)
    exact = fused_moe_ref(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2,
                          compute_dtype=torch.float64, quantize=False)
    quant_err = _rel(fused_moe_ref(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2,
                                   compute_dtype=torch.float64), exact)
    err = _rel(out, exact)
    assert err <= 1.02 * quant_err + 1e-4
    assert 0.003 < err < 0.06


@pytest.mark.parametrize("fp8,cfg,split", [(False, CFG_A, 3), (True, CFG_Q, 2), (True, dict(CFG_B, BLOCK_SIZE_K=64), 3)],
                         ids=["float-3", "fp8-quant-in-gemm-2", "fp8-3"])
def test_fused_moe_split_k(poison, fp8, cfg, split):
    """Both GEMMs with the K loop split (gate and up summed part by part before SiLU, down's parts before the
    routing weight): the unsplit result within float32 reordering, the arrival counts back at 0, and the same
    bits on a second launch (as a CUDA-graph replay)."""
    from kernels.split_k import arrivals

    t, e, top_k, n, k = 3, 5, 2, 200, 300  # K 300 and N 200: 3 and 2 blocks of 128, uneven parts
    x = torch.randn(t, k, generator=_gen(11))
    w13, w2, s13, s2 = _weights(e, n, k, seed=12, fp8=fp8)
    ids, weights = _routing(t, e, top_k, seed=13)
    kw = dict(w13_scale=s13, w2_scale=s2) if fp8 else {}
    whole = fused_moe(x, w13, w2, ids, weights, config=dict(cfg, SPLIT_K=1), **kw)
    out = fused_moe(x, w13, w2, ids, weights, config=dict(cfg, SPLIT_K=split), **kw)
    assert (out - whole).abs().max() <= 1e-5 * whole.abs().max() and whole.abs().max() > 0
    assert not arrivals(x.device).any()
    assert torch.equal(fused_moe(x, w13, w2, ids, weights, config=dict(cfg, SPLIT_K=split), **kw), out)


def test_fused_moe_fp8_many_experts(poison):
    """E = 300 (BLOCK_E 512): the alignment takes its three-launch path (no prologue)."""
    t, e, top_k, n, k = 50, 300, 3, 40, 64
    x = torch.randn(t, k, generator=_gen(3))
    q13, q2, s13, s2 = _weights(e, n, k, seed=5, fp8=True)
    ids, weights = _routing(t, e, top_k, seed=6)
    out = fused_moe(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, config=CFG_A)
    mirror = fused_moe_ref(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    assert not out.isnan().any() and _rel(out, mirror) < 1e-4


def test_fused_moe_bf16_default_config(poison):
    t, e, top_k, n, k = 5, 6, 2, 64, 128
    x = torch.randn(t, k, generator=_gen(0)).bfloat16()
    w13, w2, _, _ = _weights(e, n, k, seed=3, fp8=False)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    ids, weights = _routing(t, e, top_k, seed=9)
    out = fused_moe(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    exact = fused_moe_ref(x, w13, w2, ids, weights, compute_dtype=torch.float64, quantize=False)
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, weights)) < 2e-3
    assert _rel(out, exact) < 1e-2


def test_fused_moe_expert_parallel_ids(poison):
    """Ids of -1 (experts on another EP rank) contribute nothing; tokens with none give zeros."""
    t, e, top_k, n, k = 9, 5, 3, 40, 96
    x = torch.randn(t, k, generator=_gen(1))
    q13, q2, s13, s2 = _weights(e, n, k, seed=2, fp8=True)
    ids, weights = _routing(t, e, top_k, seed=4, drop=0.4)
    ids[0] = -1
    out = fused_moe(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, config=CFG_A)
    mirror = fused_moe_ref(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    assert not out.isnan().any() and torch.equal(out[0], torch.zeros(k))
    assert _rel(out, mirror) < 1e-4


def test_fused_moe_empty_batch_and_checks():
    e, n, k = 4, 32, 64
    w13, w2, _, _ = _weights(e, n, k, seed=0, fp8=False)
    out = fused_moe(torch.randn(0, k), w13, w2, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2))
    assert out.shape == (0, k)
    q13, q2, s13, s2 = _weights(e, n, k, seed=0, fp8=True)
    ids, weights = _routing(3, e, 2, seed=1)
    with pytest.raises(ValueError):
        fused_moe(torch.randn(3, k), q13, q2, ids, weights)  # FP8 without scales
    with pytest.raises(ValueError):
        fused_moe(torch.randn(3, k + 1), w13, w2, ids, weights)
