"""Block-FP8 linear: the Triton W8A8 GEMM on CUDA (or under TRITON_INTERPRET=1), exact dequantisation otherwise."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.model.layers import dequant_block_fp8


@torch.compiler.disable
def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from kernels.fp8 import block_fp8_matmul

        return block_fp8_matmul(x, weight, scale_inv, block)
    return F.linear(x, dequant_block_fp8(weight, scale_inv, block, x.dtype))
