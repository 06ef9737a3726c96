"""The residual add fused into the RMSNorm kernels (kernels/rms_norm.py `add_rms_norm_triton`,
kernels/rms_norm_quant.py `add_rms_norm_quant`), under the Triton interpreter on CPU (and, marked gpu, at
DeepSeek's shapes on a GPU).

What they replace in a decoder layer is torch's add of the sublayer output to the residual stream, then the norm
kernel (or the fused norm + quantisation) on that sum. So: the sum they store is bit-equal to torch's `x +
residual`, and the normalised (or quantised) rows are bit-equal to the unfused kernel's on that sum (the same
tile, the same warps: the same sum of squares). Random rows of several magnitudes (never zeros), bf16 and fp32,
hidden sizes that are and are not whole groups, strided rows, no rows; outputs start as NaN (`poison`)."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_triton
from kernels.rms_norm_quant import add_rms_norm_quant, add_rms_norm_quant_ref, rms_norm_quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_SHAPES = [(1, 256), (5, 200), (3, 1536), (17, 64)]
GPU_SHAPES = [(1, 7168), (7, 7168), (64, 5120), (300, 7168), (3, 1536)]


def _inputs(rows, hidden, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(2 * torch.randn(rows, 1, generator=g))
    x = (torch.randn(rows, hidden + 8, generator=g) * scale).to(dtype).to(DEVICE)
    r = (torch.randn(rows, hidden, generator=g) * scale * 3).to(dtype).to(DEVICE)
    w = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    return (x[:, 8:] if strided else x[:, :hidden].contiguous()), r, w


def _check(rows, hidden, dtype, strided=False):
    x, r, w = _inputs(rows, hidden, dtype, seed=rows * 31 + hidden, strided=strided)
    normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, rms_norm_triton(x + r, w, 1e-6))
    q, s, summed_q = add_rms_norm_quant(x, r, w, 1e-6)
    rq, rs = rms_norm_quant(x + r, w, 1e-6)
    assert torch.equal(summed_q, x + r) and s.stride(0) == 1  # column-major scales, as rms_norm_quant's
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", CPU_SHAPES)
def test_bit_equal_to_the_add_then_the_unfused_kernel(poison, dtype, rows, hidden):
    _check(rows, hidden, dtype)


def test_strided_rows(poison):
    _check(4, 256, torch.bfloat16, strided=True)


def test_against_the_torch_form(poison):
    """The references are the add, then the norm (and quantisation) references of the sum: the kernels match them
    to the RMSNorm kernel's tolerance (torch sums the squares in another order)."""
    x, r, w = _inputs(6, 384, torch.bfloat16, seed=5)
    normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
    r_normed, r_summed = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(summed, r_summed)
    torch.testing.assert_close(normed, r_normed, rtol=2.0**-6, atol=1e-5)
    q, s, _ = add_rms_norm_quant(x, r, w, 1e-6)
    rq, rs, _ = add_rms_norm_quant_ref(x, r, w, 1e-6)
    torch.testing.assert_close(s, rs, rtol=2.0**-6, atol=0)
    assert (q.float() != rq.float()).float().mean() <= 0.02


def test_no_rows_and_mismatches(poison):
    x, r, w = _inputs(0, 256, torch.bfloat16)
    normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
    assert normed.shape == summed.shape == (0, 256)
    q, s, summed = add_rms_norm_quant(x, r, w, 1e-6)
    assert q.shape == (0, 256) and s.shape == (0, 2) and summed.shape == (0, 256)
    x, r, w = _inputs(2, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported"):
        add_rms_norm_triton(x, r.float(), w, 1e-6)  # the sum's dtype would be ambiguous
    with pytest.raises(ValueError, match="unsupported"):
        add_rms_norm_quant(x, r[:1], w, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's sum of squares follows the compiled layout")
@pytest.mark.parametrize("rows,hidden", GPU_SHAPES)
def test_gpu_bit_equal(poison, rows, hidden):
    _check(rows, hidden, torch.bfloat16)
