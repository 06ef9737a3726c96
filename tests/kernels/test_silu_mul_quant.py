"""SiLU(gate) * up fused with the FP8 group quantisation of the GEMM after it (kernels/silu_mul_quant.py)
against its torch reference (F.silu, the product, kernels/fp8_math.py's group quantisation).

CPU: Triton interpreter, whose exp is numpy's (not CUDA's): a silu may land one rounding step of the activation
dtype away, so a few e4m3 values may differ by one step; everything else must agree. GPU (marked gpu): the
kernel computes silu as torch's CUDA kernel does and quantises as kernels/fp8.py's Triton group quantisation does
(the engine's path without it), so every value and scale is bit-equal to those at DeepSeek's shapes.
Random rows (never zeros) of several magnitudes, a partial last group, strided rows (a view of a wider buffer),
no rows; outputs start as NaN (`poison`)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import per_token_group_quant_fp8
from kernels.fp8_math import dequant_groups
from kernels.silu_mul_quant import silu_mul_quant, silu_mul_quant_ref, supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _input(rows, inter, dtype, scale=1.0, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    wide = (scale * torch.randn(rows, 2 * inter + pad, generator=g)).to(dtype).to(DEVICE)
    return wide[:, pad:]  # rows strided when padded


def _check(x, exact):
    q, s = silu_mul_quant(x)
    rq, rs = silu_mul_quant_ref(x)
    if exact:  # the engine's path without the kernel: torch's SiLU and product, then the Triton group quantisation
        gate, up = x.chunk(2, dim=-1)
        rq, rs = per_token_group_quant_fp8(torch.nn.functional.silu(gate) * up, column_major_scales=True)
    assert q.shape == rq.shape and s.shape == rs.shape and s.stride(0) == 1  # column-major scales
    if exact:
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        return
    torch.testing.assert_close(s, rs, rtol=2.0**-7, atol=0)
    got, ref = dequant_groups(q, s), dequant_groups(rq, rs)
    torch.testing.assert_close(got, ref, rtol=2.0**-2, atol=float(rs.max()) * 2.0**-6)
    assert (q.float() != rq.float()).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter,pad", [(1, 256, 0), (3, 320, 64), (5, 1024, 0), (2, 96, 16)])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_matches_reference(poison, dtype, rows, inter, pad, scale):
    _check(_input(rows, inter, dtype, scale, seed=rows + inter, pad=pad), exact=False)


def test_no_rows_and_unsupported():
    q, s = silu_mul_quant(_input(0, 256, torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    assert not supported(_input(2, 256, torch.bfloat16)[:, :-1])  # odd width: no gate / up halves
    assert not supported(_input(2, 256, torch.bfloat16).t())  # columns strided


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bit-equality with torch's CUDA silu needs a GPU")
@pytest.mark.parametrize("rows,inter", [(1, 18432 // 8), (7, 2048), (64, 1536), (300, 4608), (1, 2048 * 2)])
def test_bit_equal_on_gpu(poison, rows, inter):
    _check(_input(rows, inter, torch.bfloat16, seed=rows), exact=True)
