"""Rotary embeddings for the qk_rope part of MLA: interleaved pairs, optional YaRN.

DeepSeek rotates dimension pairs (x[2i], x[2i+1]) by one frequency each. The
output keeps that interleaved layout; q and k are rotated the same way, so their
dot products equal those of any other consistent layout.
"""

from __future__ import annotations

import math

import torch

from engine.checkpoint.config import RopeConfig, yarn_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq_and_scale(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, dim/2) and the cos/sin magnitude factor."""
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    base_freq = 1.0 / (rope.theta**exps)
    if rope.kind != "yarn":
        return base_freq.float(), 1.0
    low = math.floor(_yarn_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position_embeddings))
    high = math.ceil(_yarn_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position_embeddings))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates by `factor`
    freq = base_freq / rope.factor * (1 - extrapolate) + base_freq * extrapolate
    scale = 1.0
    if rope.mscale and rope.mscale_all_dim:
        scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        scale = yarn_mscale(rope.factor)
    return freq.float(), float(scale)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions) (no host sync: CUDA-graph safe)."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int, device: torch.device):
        self.rope, self.dim, self.device = rope, dim, device
        inv_freq, self.scale = inv_freq_and_scale(rope, dim)
        self.inv_freq = inv_freq.to(device)
        t = torch.arange(max(int(max_positions), 1), dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq)
        self.cos = freqs.cos() * self.scale
        self.sin = freqs.sin() * self.scale

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, ..., dim] at positions [T] (interleaved pairs)."""
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (self.dim // 2,)
        cos = self.cos[positions].view(shape)
        sin = self.sin[positions].view(shape)
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.to(x.dtype)
