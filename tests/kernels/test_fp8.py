"""FP8 kernels vs their torch references: group quantisation, block-FP8 GEMM, FP8 bmm.

Each kernel is checked twice: against its `*_ref` twin (same roundings: float32-level
agreement) and against the float64 product of the unquantised inputs, within the e4m3
quantisation error (relative 2**-4 per operand, the bound of round-to-nearest with 3
mantissa bits). Outputs are poisoned (NaN) before each call.
"""

import pytest
import torch

from kernels.fp8 import (
    block_fp8_matmul,
    block_fp8_matmul_q,
    block_fp8_matmul_ref,
    fp8_bmm,
    fp8_bmm_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from kernels.fp8_math import (
    FP8_DTYPE,
    FP8_MAX,
    deinterleave_groups,
    dequant_groups,
    expand_block_scale,
    quantize_block_fp8,
)

U = 2.0 ** -4  # e4m3 unit roundoff (half an ulp, relative)

# These tests hand CPU tensors to the Triton kernels, which only the interpreter (conftest.py,
# no GPU) accepts; on a GPU machine benchmarks/bench_moe_fp8.py checks every kernel at V3 shapes.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test on CPU tensors; "
                              "on a GPU run benchmarks/bench_moe_fp8.py (checks at DeepSeek-V3 shapes)")


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    # rows of very different magnitudes, so per-group scales matter
    x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    return x.to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _assert_same_fp8(q, q_ref):
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape
    assert not q.float().isnan().any()
    assert torch.equal(q.float(), q_ref.float())


# --------------------------------------------------------------------------- quantisation


@cpu_only
@pytest.mark.parametrize("m,k,group", [(1, 128, 128), (7, 300, 128), (33, 1000, 128), (5, 200, 64), (4, 17, 128)])
def test_group_quant_matches_ref(poison, m, k, group):
    x = _rand(m, k, seed=m * k)
    q, s = per_token_group_quant_fp8(x, group)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, group)
    assert s.shape == (m, -(-k // group)) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    _assert_same_fp8(q, q_ref)
    # against float64: round-to-nearest e4m3, |err| <= u |x| (normals) or half the subnormal step
    deq = dequant_groups(q, s, group).double()
    step = s.double().repeat_interleave(group, -1)[:, :k] * 2.0 ** -10
    assert ((deq - x.double()).abs() <= U * x.double().abs() + step * 1.001).all()
    # the largest element of each group maps to +-448
    assert torch.allclose(q.float().abs().amax(-1), torch.full((m,), FP8_MAX))


@cpu_only
def test_group_quant_column_major_scales(poison):
    x = _rand(9, 384, seed=3, dtype=torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, column_major_scales=True)
    q_rm, s_rm = per_token_group_quant_fp8(x)
    assert s.shape == (9, 3) and s.stride() == (1, 9)
    assert torch.equal(s, s_rm) and torch.equal(q.float(), q_rm.float())


@cpu_only
def test_group_quant_deinterleaved(poison):
    """deinterleave=True (the swapped W4AFP8 GEMM's activation order): the same codes and scales, each group's
    even columns first, then its odd ones; with sums=True also each group's sum of its codes; both launch paths
    of the MoE prologue agree with it."""
    from kernels.moe_align import align_plan
    from kernels.moe_common import align_and_quant

    x = _rand(5, 384, seed=4, dtype=torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, 128)
    qd, sd = per_token_group_quant_fp8(x, 128, deinterleave=True)
    assert torch.equal(sd, s)
    assert torch.equal(qd.float(), deinterleave_groups(q.float(), 128))
    assert torch.equal(deinterleave_groups(torch.arange(8.0), 4), torch.tensor([0.0, 2, 1, 3, 4, 6, 5, 7]))
    want_sums = qd.double().view(5, 3, 128).sum(-1)  # sums=True: each group's sum of its codes (unscaled)
    q3, s3, t3 = per_token_group_quant_fp8(x, 128, deinterleave=True, sums=True)
    assert torch.equal(q3.float(), qd.float()) and torch.equal(s3, s) and t3.dtype == torch.float32
    torch.testing.assert_close(t3.double(), want_sums, rtol=1e-6, atol=1e-3)
    for experts, n_ids in ((8, 10), (1024, 200)):  # the one-launch prologue, then alignment launches + quantisation
        assert align_plan(n_ids, experts, 16).small == (n_ids == 10)
        ids = torch.randint(0, experts, (n_ids,), dtype=torch.int32)
        _, qa, sa = align_and_quant(x, ids, experts, 16, 128, deinterleave=True)
        assert torch.equal(qa.float(), qd.float()) and torch.equal(sa, s)
        _, qa, sa, ta = align_and_quant(x, ids, experts, 16, 128, deinterleave=True, sums=True)
        assert torch.equal(qa.float(), qd.float()) and torch.equal(sa, s) and torch.equal(ta, t3)
    with pytest.raises(ValueError, match="whole groups"):
        per_token_group_quant_fp8(x[:, :200], 128, deinterleave=True)


@cpu_only
def test_group_sums_are_the_stored_codes_sums_when_the_cast_rounds(poison):
    """On a GPU the quantiser leaves the rounding to e4m3 to its cast (EXACT_ROUND off): the group sums must be
    the sums of the codes stored, not of the values before the cast (which put the W4AFP8 GEMM's offset
    correction off by ~10% on an H200). Launched here as the GPU launches it; the interpreter's cast rounds too
    (if differently), so the sums must match what it stored."""
    from kernels.fp8 import _group_quant_kernel

    x = _rand(4, 256, seed=9)
    q = torch.empty(4, 256, dtype=FP8_DTYPE)
    s = torch.empty(4, 2)
    total = torch.empty(4, 2)
    _group_quant_kernel[(4, 1)](x, q, s, total, 256, x.stride(0), q.stride(0), s.stride(0), s.stride(1), 1e-10,
                                GROUP=128, GROUPS_PER_PROG=2, EXACT_ROUND=False, SUMS=True, num_warps=4)
    stored = q.double().view(4, 2, 128).sum(-1)
    unrounded = (x.double() / s.double().repeat_interleave(128, dim=1)).view(4, 2, 128).sum(-1)
    assert not torch.allclose(stored, unrounded, rtol=0, atol=1e-2)  # the cast moved the sums
    torch.testing.assert_close(total.double(), stored, rtol=1e-6, atol=1e-3)


@cpu_only
def test_group_quant_rounds_to_nearest_even_across_binades(poison):
    # scale is exactly 1 (group max 448): every value must round exactly as torch's cast does,
    # including values just under a power of two (1.97 -> 2.0) and e4m3 subnormals
    grid = torch.linspace(-447.9, 447.9, 127 * 40)
    extra = torch.tensor([1.96875, 1.953125, 7.8125, 3.9, 0.0039, 0.00585, 2.0 ** -10, -0.0137, 0.0])
    x = torch.cat([grid, extra])
    x = torch.nn.functional.pad(x, (0, 128 - x.numel() % 128)).view(-1, 128)
    x[:, 0] = 448.0
    q, s = per_token_group_quant_fp8(x.reshape(1, -1))
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(q.float().view(-1), x.view(-1).to(FP8_DTYPE).float())


@cpu_only
def test_group_quant_empty():
    q, s = per_token_group_quant_fp8(torch.randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)


# --------------------------------------------------------------------------- block GEMM

CFGS = [
    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
    dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=2, num_warps=4, num_stages=2),
    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2, QUANT_A=1),
]


def _bound(a, w):
    """Elementwise bound on |quant(a) @ quant(w).T - a @ w.T| (two operands, each within u)."""
    return (2 * U + U * U) * (a.double().abs() @ w.double().abs().T)


@cpu_only
@pytest.mark.parametrize("cfg", CFGS, ids=["bn32", "bn256", "quant_in_gemm"])
@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (37, 130, 257), (19, 300, 128)])
def test_block_fp8_matmul(poison, cfg, m, n, k):
    a = _rand(m, k, seed=m + n)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    wq, ws = quantize_block_fp8(w)
    out = block_fp8_matmul(a, wq, ws, config=cfg)
    assert out.shape == (m, n) and out.dtype == a.dtype and not out.isnan().any()
    assert _rel(out, block_fp8_matmul_ref(a, wq, ws)) < 1e-5
    w_deq = wq.float() * expand_block_scale(ws, n, k, (128, 128))
    exact = a.double() @ w_deq.double().T
    assert ((out.double() - exact).abs() <= U * a.double().abs() @ w_deq.double().abs().T + 1e-5).all()
    exact_unq = a.double() @ w.double().T
    assert ((out.double() - exact_unq).abs() <= _bound(a, w) + 1e-5).all()
    assert _rel(out, exact_unq) < 0.06


@cpu_only
def test_block_fp8_matmul_bf16_batched_and_out(poison):
    a = _rand(2, 5, 256, seed=1, dtype=torch.bfloat16)
    wq, ws = quantize_block_fp8(torch.randn(96, 256) * 0.1)
    cfg = CFGS[0]
    out = block_fp8_matmul(a, wq, ws, config=cfg)
    assert out.shape == (2, 5, 96) and out.dtype == torch.bfloat16
    assert _rel(out, block_fp8_matmul_ref(a, wq, ws)) < 2e-3
    buf = torch.full((96, 10), float("nan"), dtype=torch.bfloat16)
    res = block_fp8_matmul(a.reshape(10, 256), wq, ws, config=cfg, out=buf.t())
    assert torch.equal(res, out.reshape(10, 96)) and torch.equal(buf.t(), out.reshape(10, 96))


@cpu_only
def test_block_fp8_matmul_prequantised(poison):
    a = _rand(21, 300, seed=8)
    wq, ws = quantize_block_fp8(torch.randn(70, 300) * 0.1)
    aq, a_s = per_token_group_quant_fp8(a)  # row-major scales work too
    out = block_fp8_matmul_q(aq, a_s, wq, ws, out_dtype=torch.float32, config=CFGS[1])
    assert _rel(out, block_fp8_matmul_ref(a, wq, ws)) < 1e-5


@cpu_only
def test_block_fp8_matmul_cublas_config_falls_back_off_gpu(poison):
    """CUBLAS=1 only applies on a GPU with cuBLASLt block scaling; elsewhere the same dict runs Triton."""
    a = _rand(5, 512, seed=9)
    wq, ws = quantize_block_fp8(torch.randn(130, 512) * 0.1)
    cfg = dict(CFGS[0], CUBLAS=1)
    assert _rel(block_fp8_matmul(a, wq, ws, config=cfg), block_fp8_matmul_ref(a, wq, ws)) < 1e-5


@cpu_only
def test_block_fp8_matmul_cublas_false_ignores_the_cublas_key(monkeypatch, poison):
    """--gemm-backend triton (cublas=False): the Triton kernel even where the config says CUBLAS and cuBLASLt
    could run; the default takes cuBLASLt there (both faked here: no GPU)."""
    import kernels.fp8 as fp8

    calls = []
    monkeypatch.setattr(fp8, "cublas_block_fp8_supported", lambda *a: True)
    marker = torch.full((5, 130), 7.0)
    monkeypatch.setattr(fp8, "cublas_block_fp8_matmul", lambda aq, *a: calls.append(tuple(aq.shape)) or marker)
    a = _rand(5, 512, seed=9)
    wq, ws = quantize_block_fp8(torch.randn(130, 512) * 0.1)
    cfg = dict(CFGS[0], CUBLAS=1)
    assert torch.equal(block_fp8_matmul(a, wq, ws, config=cfg), marker) and calls == [(5, 512)]
    out = block_fp8_matmul(a, wq, ws, config=cfg, cublas=False)
    assert calls == [(5, 512)] and _rel(out, block_fp8_matmul_ref(a, wq, ws)) < 1e-5


@cpu_only
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("cfg", [CFGS[0], CFGS[2]], ids=["prequant", "quant_in_gemm"])
def test_block_fp8_matmul_split_k(poison, cfg, split):
    """K cut into `split` runs of blocks (5 blocks: 3+2, 2+2+1, 2+2+1+none), each tile's partials summed by its
    last program in split order: within float32 reordering of the unsplit result, the arrival counts back at 0
    (a second launch, as a CUDA-graph replay, gives the same bits)."""
    from kernels.split_k import arrivals

    a = _rand(3, 5 * 128 - 40, seed=split)
    wq, ws = quantize_block_fp8(torch.randn(100, a.shape[1], generator=torch.Generator().manual_seed(5)) * 0.1)
    whole = block_fp8_matmul(a, wq, ws, config=cfg)
    out = block_fp8_matmul(a, wq, ws, config=dict(cfg, SPLIT_K=split))
    assert (out - whole).abs().max() <= 1e-5 * whole.abs().max() and not torch.equal(out, torch.zeros_like(out))
    assert _rel(out, block_fp8_matmul_ref(a, wq, ws)) < 1e-5
    assert not arrivals(a.device).any()
    assert torch.equal(block_fp8_matmul(a, wq, ws, config=dict(cfg, SPLIT_K=split)), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the split-K reduction across SMs needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (3, 5120, 4096), (16, 1536, 5120)])  # V3 TP 1, V2 TP 4
def test_block_fp8_matmul_split_k_gpu(m, n, k):
    """At decode shapes on the GPU: every split (and the automatic one) within float32 reordering of the unsplit
    GEMM, the same bits on every launch and in a CUDA graph's replays (the last program of a tile always sums
    the parts in split order), and the arrival counts back at 0."""
    from tests.kernels.split_k_checks import same_bits_every_launch_and_replay

    g = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    cfg = dict(CFGS[0], num_stages=4)
    whole = block_fp8_matmul(a, wq, ws, config=dict(cfg, SPLIT_K=1))
    for split_cfg in [cfg] + [dict(cfg, SPLIT_K=s) for s in (2, 3, 4, 8)]:
        same_bits_every_launch_and_replay(lambda out=None, c=split_cfg: block_fp8_matmul(a, wq, ws, config=c, out=out),
                                          whole)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt block-scaled FP8 needs a CUDA GPU")
@pytest.mark.parametrize("k", [1024, 2304])  # 2304: K % 512 != 0 must take the Triton kernel
def test_block_fp8_matmul_cublas_gpu(k):
    a = torch.randn(37, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_block_fp8(torch.randn(384, k, device="cuda") * 0.1)
    cfg = dict(CFGS[0], CUBLAS=1)
    out = block_fp8_matmul(a, wq, ws, config=cfg)
    assert _rel(out, block_fp8_matmul_ref(a, wq, ws, out_dtype=torch.float32)) < 5e-3


@cpu_only
def test_block_fp8_matmul_empty_and_default_config():
    wq, ws = quantize_block_fp8(torch.randn(64, 128))
    assert block_fp8_matmul(torch.randn(0, 128), wq, ws).shape == (0, 64)
    a = _rand(3, 128)
    assert _rel(block_fp8_matmul(a, wq, ws), block_fp8_matmul_ref(a, wq, ws)) < 1e-5
    with pytest.raises(ValueError):
        block_fp8_matmul(torch.randn(3, 100), wq, ws)


# --------------------------------------------------------------------------- FP8 bmm (absorbed MLA)


def _bmm_weights(h, k, n, seed):
    w = torch.randn(h, k, n, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w


@cpu_only
@pytest.mark.parametrize("scale_kind", ["tensor", "head", "block"])
def test_fp8_bmm(poison, scale_kind):
    h, m, k, n = 3, 11, 200, 144
    w = _bmm_weights(h, k, n, seed=7)
    if scale_kind == "block":  # checkpoint-style [N, K] tiles, used through a transposed view
        wq_t, ws_t = quantize_block_fp8(w.transpose(1, 2).contiguous())
        wq, ws = wq_t.transpose(1, 2), ws_t.transpose(1, 2)
    else:
        per = w.abs().amax(dim=(1, 2)) / FP8_MAX
        ws = per if scale_kind == "head" else w.abs().amax().reshape(1) / FP8_MAX
        wq = (w / ws.view(-1, 1, 1)).to(FP8_DTYPE)
    # a [H, M, K] as a transposed view of a [M, H, K] buffer, like q_nope
    a = _rand(m, h, k, seed=2).transpose(0, 1)
    out = fp8_bmm(a, wq, ws)
    assert out.shape == (h, m, n) and not out.isnan().any()
    assert _rel(out, fp8_bmm_ref(a, wq, ws)) < 1e-5
    exact = torch.bmm(a.double(), w.double())
    bound = (2 * U + U * U) * torch.bmm(a.double().abs(), w.double().abs())
    assert ((out.double() - exact).abs() <= bound + 1e-5).all()
    assert _rel(out, exact) < 0.06


@cpu_only
def test_fp8_bmm_strided_out_bf16_and_empty(poison):
    h, m, k, n = 2, 5, 128, 64
    w = _bmm_weights(h, k, n, seed=1)
    ws = w.abs().amax(dim=(1, 2)) / FP8_MAX
    wq = (w / ws.view(-1, 1, 1)).to(FP8_DTYPE)
    a = _rand(h, m, k, seed=4, dtype=torch.bfloat16)
    buf = torch.full((m, h, n), float("nan"), dtype=torch.bfloat16)
    fp8_bmm(a, wq, ws, out=buf.transpose(0, 1))
    assert not buf.isnan().any()
    assert _rel(buf.transpose(0, 1), fp8_bmm_ref(a, wq, ws)) < 2e-3
    assert fp8_bmm(a[:, :0], wq, ws).shape == (h, 0, n)
    with pytest.raises(ValueError):
        fp8_bmm(a, wq, torch.ones(3))
