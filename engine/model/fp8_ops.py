"""Block-FP8 linear (W8A8: 1x128 activation groups, 128x128 weight blocks): the implementations the
kernel registry (engine/model/kernel_registry.py, op "gemm") chooses from.

- `cublas_linear`: the Triton GEMM of kernels/fp8.py, taking cuBLASLt's block-scaled FP8 GEMM where the
  tuned config says CUBLAS (and the shape allows it);
- `triton_linear`: the Triton GEMM only (the tuned configs' CUBLAS key is ignored);
- `torch_linear`: the exact dequantised product (kernels/fp8_math.py).

Each has a `*_q` twin for an activation quantised already (the fused RMSNorm + quantisation of
engine/model/norm_ops.py): (q [M, K] e4m3, 1 x 128 group scales, weight, scale_inv, block, out dtype).

All are opaque to torch.compile (`torch.compiler.disable`), as the one `linear` they replace was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import block_fp8_matmul, block_fp8_matmul_q
from kernels.fp8_math import dequant_block_fp8, dequant_groups


@torch.compiler.disable
def cublas_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                  block: tuple[int, int]) -> torch.Tensor:
    return block_fp8_matmul(x, weight, scale_inv, block)


@torch.compiler.disable
def triton_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                  block: tuple[int, int]) -> torch.Tensor:
    return block_fp8_matmul(x, weight, scale_inv, block, cublas=False)


@torch.compiler.disable
def torch_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor:
    return F.linear(x, dequant_block_fp8(weight, scale_inv, block, x.dtype))


@torch.compiler.disable
def cublas_linear_q(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    return block_fp8_matmul_q(q, q_scale, weight, scale_inv, block, out_dtype)


@torch.compiler.disable
def triton_linear_q(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    return block_fp8_matmul_q(q, q_scale, weight, scale_inv, block, out_dtype, cublas=False)


@torch.compiler.disable
def torch_linear_q(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    x = dequant_groups(q, q_scale, block[1])
    return F.linear(x, dequant_block_fp8(weight, scale_inv, block, torch.float32)).to(out_dtype)
