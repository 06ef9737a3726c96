"""Block-FP8 linear (W8A8: 1x128 activation groups, 128x128 weight blocks).

The Triton GEMM of kernels/fp8.py on CUDA, or on CPU tensors under Triton's interpreter
(kernels/interpret.py); otherwise the exact dequantised product (kernels/fp8_math.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_math import dequant_block_fp8
from kernels.interpret import interpreting


@torch.compiler.disable
def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if x.is_cuda or interpreting():
        from kernels.fp8 import block_fp8_matmul

        return block_fp8_matmul(x, weight, scale_inv, block)
    return F.linear(x, dequant_block_fp8(weight, scale_inv, block, x.dtype))
