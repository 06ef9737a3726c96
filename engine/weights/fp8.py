"""Block-wise FP8 (e4m3) weight quantisation, as DeepSeek-V3 checkpoints store it.

Each (block_n x block_k) tile of a weight has one float32 `weight_scale_inv`;
the real weight is fp8 * scale. Dequantisation lives in engine.model.layers.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 weight [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)])."""
    bn, bk = block
    *lead, n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.zeros(*lead, pn, pk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    tiles = padded.view(*lead, pn // bn, bn, pk // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, pn, pk)[..., :n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()
