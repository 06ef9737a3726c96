"""Block-FP8 (e4m3) maths in plain torch: the one home of scale shapes, quantisation, dequantisation.

Formats (DeepSeek-V3 "fp8 block" checkpoints):
- weights [..., N, K]: one float32 scale per (block_n x block_k) tile, the checkpoint's
  `weight_scale_inv`, shape [..., ceil(N/bn), ceil(K/bk)]; the real weight is fp8 * scale;
- activations [..., K]: 1 x group tiles along K (the same maths with block (1, group)),
  quantised on the fly before each FP8 GEMM.
Quantisation: s = max|tile| / 448 (clamped below by eps), q = clamp(x / s, +-448) cast to e4m3.

Everything here is exact and runs on any device (no Triton): the checkpoint loader, the
dequantised CPU path of the model, the dummy-weight and tiny-checkpoint writers, and the
pure-torch references of the FP8 kernels (kernels/fp8.py, kernels/fused_moe.py) all use it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP_SIZE = 128  # activation group along K
WEIGHT_BLOCK = (128, 128)  # DeepSeek-V3's weight tiles
ACT_EPS = 1e-10  # smallest activation group max (all-zero groups get a tiny, finite scale)
WEIGHT_EPS = 1e-12  # same for weight tiles


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape of a [..., N, K] tensor quantised in (bn x bk) tiles: [..., ceil(N/bn), ceil(K/bk)]."""
    *lead, n, k = shape
    return (*lead, cdiv(n, block[0]), cdiv(k, block[1]))


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int],
                       offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """[..., nb, kb] tile scales -> [..., rows, cols] per-element float32 scales.

    offset: where the tensor starts inside its first tile (a slice that does not begin on a tile
    boundary, e.g. a tensor-parallel shard); (0, 0) for a whole tensor."""
    r0, c0 = offset
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., r0:r0 + rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., c0:c0 + cols]


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N, K] -> (e4m3 [..., N, K], float32 scales block_scale_shape(x.shape, block)).

    Ragged edge tiles are padded with zeros (which do not change a tile's max)."""
    bn, bk = block
    *lead, n, k = x.shape
    pn, pk = cdiv(n, bn) * bn, cdiv(k, bk) * bk
    padded = torch.zeros(*lead, pn, pk, dtype=torch.float32, device=x.device)
    padded[..., :n, :k] = x.float()
    tiles = padded.view(*lead, pn // bn, bn, pk // bk, bk)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=eps) / FP8_MAX
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, pn, pk)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight w [..., N, K] -> (fp8 weight [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)])."""
    return quantize_blocks(w, block, WEIGHT_EPS)


def quantize_groups(x: torch.Tensor, group_size: int = GROUP_SIZE,
                    eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [..., K] in 1 x group tiles -> (e4m3 [..., K], float32 scales [..., ceil(K/group)])."""
    *lead, k = x.shape
    q, s = quantize_blocks(x.reshape(math.prod(lead), k), (1, group_size), eps)
    return q.view(*lead, k), s.view(*lead, s.shape[-1])


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Exact block dequantisation of [..., N, K]: weight * scale, one scale per (bn x bk) tile
    (offset: see expand_block_scale)."""
    n, k = weight.shape[-2:]
    return (weight.float() * expand_block_scale(scale_inv, n, k, block, offset)).to(dtype)


def deinterleave_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] with each 1 x group_size group's even columns first, then its odd ones (K whole groups):
    the activation order of the W4AFP8 kernel that meets packed INT4 bytes (elements 2j, 2j + 1) nibble by
    nibble."""
    *lead, k = x.shape
    return x.reshape(*lead, k // group_size, group_size // 2, 2).transpose(-1, -2).reshape(*lead, k)


def dequant_groups(q: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Inverse of `quantize_groups`, in float32."""
    s = scale.float().repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]
    return q.float() * s
