"""Building blocks: RMSNorm, linear layers (plain or block-FP8 weights), dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn


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


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact block dequantisation: weight * scale, one scale per (block_n x block_k) tile."""
    bn, bk = block
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * s).to(dtype)


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
            bn, bk = fp8_block
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32), requires_grad=False
            )

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
