"""INT4 weights in plain torch: symmetric group-wise quantisation along K, packing two per byte.

Format (the W4AFP8 routed experts; the layout SGLang's `w4afp8` method reads, docs/quantization.md):
- a weight [..., N, K] is quantised in 1 x `group` tiles along K: one float32 scale per
  (row, group), s = max|tile| / 7 (clamped below by eps), q = clamp(round(w / s), -8, 7);
  the real weight is q * s (the scale multiplies, like block FP8's `weight_scale_inv`);
- q is stored packed along K as int8 [..., N, K / 2]: byte j holds element 2j in its low nibble
  and element 2j + 1 in its high nibble, both two's complement;
- the scales are float32 [..., N, K / group].

Every int4 value is exactly an e4m3 number, so the fused kernel (kernels/fused_moe_w4a8.py) can run
q through FP8 tensor-core dots and apply s per group. Exact and device-agnostic: the loader's online
quantisation (on the GPU or the host), the tiny pre-quantised checkpoint writer and the kernel's reference
all use this module. `quantize_int4` gives the same bytes on every device: s is float32(max|tile| / 7)
correctly rounded and q = round-half-even of w / s exactly, both computed in float64, where they do not
depend on how a device divides (CUDA divides by a Python scalar as a multiply by its float32 reciprocal,
1 ulp off float32 division for half of all inputs; a float32 quotient can also land on a .5 tie the exact
one is not on, and float64 is far enough from both: an fp32 / 7 or fp32 / fp32 quotient is never within
2^-40 of a float32 rounding midpoint or of a .5 tie it is not on).
"""

from __future__ import annotations

import torch

INT4_MAX = 7  # scale = max|tile| / INT4_MAX; q in [-8, 7]
INT4_GROUP = 128  # the published W4AFP8 checkpoints' K group
INT4_EPS = 1e-12


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [..., K] (K even) -> int8 [..., K / 2] (element 2j low nibble, 2j + 1 high)."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last dim ({q.shape[-1]}) must be even")
    q8 = q.to(torch.int8)
    return ((q8[..., 1::2] << 4) | (q8[..., 0::2] & 0x0F)).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int8 [..., K / 2] -> int8 [..., K] in [-8, 7]."""
    p = packed.view(torch.int8)
    low = (p << 4) >> 4  # arithmetic shift sign-extends the low nibble
    high = p >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def check_group(k: int, group: int) -> None:
    if group < 2 or group % 2 or k % group:
        raise ValueError(f"INT4 groups of {group} along K do not tile K = {k}")


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (packed int8 [..., N, K / 2], float32 scales [..., N, K / group])."""
    *lead, n, k = w.shape
    check_group(k, group)
    tiles = w.float().double().reshape(*lead, n, k // group, group)  # float32 values, held exactly
    scale = (tiles.abs().amax(dim=-1).clamp(min=INT4_EPS) / INT4_MAX).float()
    q = torch.round(tiles / scale.double()[..., None]).clamp(-8, INT4_MAX)
    return pack_int4(q.reshape(*lead, n, k)), scale.contiguous()


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., N, K / 2] with scales [..., N, G] -> [..., N, K] (group = K / G)."""
    q = unpack_int4(packed).float()
    group = q.shape[-1] // scale.shape[-1]
    return (q * scale.float().repeat_interleave(group, dim=-1)).to(dtype)


__all__ = ["INT4_GROUP", "INT4_MAX", "check_group", "dequant_int4", "pack_int4", "quantize_int4", "unpack_int4"]
