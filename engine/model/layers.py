"""Building blocks: RMSNorm, linear layers (plain or block-FP8 weights), dense MLP.

Block-FP8 shapes and dequantisation come from kernels/fp8_math.py; the FP8 product
itself is engine/model/fp8_ops.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_math import FP8_DTYPE, block_scale_shape, dequant_block_fp8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x @ W.T with W either in the model dtype or block-FP8 (+ float32 weight_scale_inv)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8_block = fp8_block
        if fp8_block is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            self.weight_scale_inv = None
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
            scale_shape = block_scale_shape((out_features, in_features), fp8_block)
            self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in a plain dtype (dequantised when FP8)."""
        if self.fp8_block is None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return dequant_block_fp8(self.weight, self.weight_scale_inv, self.fp8_block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is None:
            return F.linear(x, self.weight)
        from engine.model import fp8_ops

        return fp8_ops.linear(x, self.weight, self.weight_scale_inv, self.fp8_block)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fp8_block=None):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype, fp8_block)
        self.up_proj = Linear(hidden, inter, dtype, fp8_block)
        self.down_proj = Linear(inter, hidden, dtype, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
