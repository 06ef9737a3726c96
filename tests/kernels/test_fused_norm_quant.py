"""The fused RMSNorm + FP8 group quantisation (kernels/rms_norm_quant.py), under the Triton interpreter on CPU
(and, marked gpu, on a GPU).

- Against the two kernels it replaces (kernels/rms_norm.py's RMSNorm, then kernels/fp8.py's group
  quantisation of its output in the norm's dtype): bit-equal e4m3 values and scales, bf16 and fp32, random
  rows of very different magnitudes, hidden sizes that are and are not whole groups (and below one group),
  groups of 64, strided (column-slice) rows. The interpreter sums in numpy, so on CPU this checks every
  rounding step (the norm's bf16 rounding before the group max, the scale, the e4m3 rounding); the GPU test
  also checks the sum of squares, whose order follows from the tile and warps.
- Against the torch reference (rms_norm_ref, then quantize_groups): torch sums the squares in another order,
  so a normalised element may sit one rounding step away and then, rarely, quantise one e4m3 step away: exact
  scales (to float32 rounding) and e4m3 values equal almost everywhere, never more than one e4m3 step apart.
- No rows, unsupported inputs; the quantised pair through the block GEMM equals the GEMM of the unfused norm.
Outputs are poisoned before each call.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import block_fp8_matmul, block_fp8_matmul_q, per_token_group_quant_fp8
from kernels.fp8_math import FP8_DTYPE, dequant_groups, quantize_block_fp8
from kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kernels.rms_norm_quant import rms_norm_quant, rms_norm_quant_ref, supported

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test on CPU tensors")


def _inputs(rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    w = 1.0 + 0.5 * torch.randn(hidden, generator=g)
    return x.to(dtype), w.to(dtype)


def _check(got, ref, max_frac=0.01):
    (q, s), (rq, rs) = got, ref
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == rq.shape and s.shape == rs.shape
    assert s.stride(0) == 1 or s.shape[1] == 1 or s.shape[0] <= 1  # column-major scales
    torch.testing.assert_close(s, rs, rtol=2.0**-7, atol=0)
    qf, rqf = q.float(), rq.float()
    assert torch.isfinite(qf).all() and (rqf != 0).any()
    # one e4m3 step is at most 1/8 of the value (3 mantissa bits), or 2**-9 among the subnormals
    assert ((qf - rqf).abs() <= rqf.abs() / 8 + 2.0**-9).all()
    frac = (qf != rqf).float().mean().item()
    assert frac <= max_frac, f"{frac:.2%} of the e4m3 values differ from the reference"


def _unfused(x, w, group=128):
    """The old path: the RMSNorm kernel's output (in memory, in its dtype), then the GEMM's group quantisation."""
    return per_token_group_quant_fp8(rms_norm_triton(x, w, 1e-6), group, column_major_scales=True)


def _assert_bit_equal(got, want):
    (q, s), (wq, ws) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == wq.shape and s.shape == ws.shape
    assert s.stride(0) == 1 or s.shape[1] == 1 or s.shape[0] <= 1  # column-major scales
    assert (wq.float() != 0).float().mean() > 0.5  # a real row, not zeros
    bad = (q.view(torch.uint8) != wq.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} of {q.numel()} e4m3 values differ from the unfused kernels"
    assert torch.equal(s, ws), (s - ws).abs().max()


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden,group", [(9, 256, 128), (3, 1536, 128), (2, 200, 128), (4, 48, 128),
                                               (3, 384, 64)])
def test_bit_equal_to_the_unfused_kernels(poison, dtype, rows, hidden, group):
    x, w = _inputs(rows, hidden, dtype, seed=rows * 7 + hidden)
    _assert_bit_equal(rms_norm_quant(x, w, 1e-6, group=group), _unfused(x, w, group))


@cpu_only
def test_bit_equal_on_strided_rows(poison):
    """q_a read in place from the merged q_a / kv_a output (the RMSNorm kernel reads the same slice)."""
    x, w = _inputs(5, 288, torch.bfloat16, seed=11)
    part = x[:, :128]
    assert part.stride(0) == 288
    _assert_bit_equal(rms_norm_quant(part, w[:128], 1e-6), _unfused(part, w[:128]))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (3, 384), (2, 200), (5, 128)])
def test_matches_reference(poison, dtype, rows, hidden):
    x, w = _inputs(rows, hidden, dtype, seed=rows * 31 + hidden)
    _check(rms_norm_quant(x, w, 1e-6), rms_norm_quant_ref(x, w, 1e-6))


@cpu_only
def test_strided_rows_and_small_groups(poison):
    """A column slice of a wider row (as q_a inside the merged q_a / kv_a output), groups of 64."""
    x, w = _inputs(4, 416, torch.bfloat16, seed=5)
    part = x[:, :256]
    assert part.stride(0) == 416
    _check(rms_norm_quant(part, w[:256], 1e-6, group=64), rms_norm_quant_ref(part, w[:256], 1e-6, group=64))


@cpu_only
def test_no_rows_and_unsupported(poison):
    x, w = _inputs(0, 256, torch.bfloat16)
    q, s = rms_norm_quant(x, w, 1e-6)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    assert not supported(x.to(torch.float64), w) and not supported(x, w[:128]) and not supported(x, w, group=96)
    with pytest.raises(ValueError, match="unsupported"):
        rms_norm_quant(x, w[:128], 1e-6)


def test_reference_is_norm_then_group_quantisation():
    x, w = _inputs(3, 384, torch.float32, seed=2)
    q, s = rms_norm_quant_ref(x, w, 1e-6)
    h = rms_norm_ref(x, w, 1e-6)
    deq = dequant_groups(q, s, 128)
    assert ((deq - h).abs() <= h.abs().view(3, 3, 128).amax(-1).repeat_interleave(128, -1) / 448 * 16 + 1e-12).all()
    assert (deq - h).abs().max() > 0  # it did quantise


@cpu_only
def test_fused_operands_through_the_block_gemm(poison):
    """quant(norm(x)) then the pre-quantised GEMM equals the GEMM of norm(x) (which quantises itself)."""
    x, w = _inputs(3, 256, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    wq, ws = quantize_block_fp8(0.05 * torch.randn(288, 256, generator=g))
    q, s = rms_norm_quant_ref(x, w, 1e-6)
    got = block_fp8_matmul_q(q, s, wq, ws, out_dtype=torch.float32)
    ref = block_fp8_matmul(rms_norm_ref(x, w, 1e-6), wq, ws)
    assert ref.abs().max() > 1e-2
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,hidden", [(1, 256), (37, 256), (6, 128), (3, 1536), (200, 1536), (64, 7168)])
def test_gpu_bit_equal_to_the_unfused_kernels(rows, hidden):
    """On the GPU the sum of squares too, in bf16 (what serving runs): the fused kernel runs the RMSNorm
    kernel's tile and warps, and the bf16 rounding of the norm's output absorbs what is left of the reduction
    order (tiny-fp8's widths 256 / 128, strided as q_a in the merged output; V3's). In float32 an H100 run
    found scales 1 ulp apart at 4 of these 6 shapes (the compiler's layout for the fused kernel changes the sum's
    order), so engine/model/norm_ops.py does not fuse float32 activations on the GPU."""
    x, w = _inputs(rows, hidden + 32, torch.bfloat16, seed=rows + hidden)
    x, w = x.cuda()[:, :hidden], w.cuda()[:hidden]
    _assert_bit_equal(rms_norm_quant(x, w, 1e-6), _unfused(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,hidden", [(1, 7168), (64, 7168), (3, 1536), (200, 1536)])
def test_gpu_v3_shapes(rows, hidden):
    """On the GPU at DeepSeek-V3's widths (hidden -> qkv_a, q_lora -> q_b), bf16, as the engine calls it."""
    x, w = _inputs(rows, hidden, torch.bfloat16, seed=rows + hidden)
    x, w = x.cuda(), w.cuda()
    q, s = rms_norm_quant(x, w, 1e-6)
    rq, rs = rms_norm_quant_ref(x, w, 1e-6)
    _check((q.cpu(), s.cpu()), (rq.cpu(), rs.cpu()))
