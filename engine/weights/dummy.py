"""Random weights of the real shapes and dtypes (`--load-format dummy`), made on the target device.

FP8 parameters get random e4m3 values with per-block scales, so a dummy
DeepSeek-V3 runs the same kernels as the real checkpoint. Large tensors are
filled in chunks so no full-size float32 temporary is ever allocated.
"""

from __future__ import annotations

import torch

from kernels.fp8_math import FP8_DTYPE

_CHUNK = 1 << 24  # elements generated at a time


def _fill(p: torch.Tensor, g: torch.Generator, fn) -> None:
    flat = p.data.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        flat[start:start + n] = fn(torch.randn(n, generator=g, device=p.device)).to(p.dtype)


def fill_dummy(named_params, seed: int) -> None:
    """Fill every parameter: norms ~1, FP8 weights ~N(0,1) with scales ~0.02, others ~N(0, 0.02)."""
    params = list(named_params)
    if not params:
        return
    g = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if p.dtype == FP8_DTYPE:
            _fill(p, g, lambda x: x)
        elif name.endswith("_scale") or name.endswith("weight_scale_inv"):
            _fill(p, g, lambda x: 0.02 * (1 + 0.25 * x.abs()))
        elif "norm" in name:
            _fill(p, g, lambda x: 1 + 0.1 * x)
        elif name.endswith("e_score_correction_bias"):
            _fill(p, g, lambda x: 0.01 * x)
        else:
            _fill(p, g, lambda x: 0.02 * x)
