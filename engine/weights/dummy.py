"""Random weights of the real shapes and dtypes (`--load-format dummy`), made on the target device.

FP8 parameters get random e4m3 values with per-block scales, so a dummy
DeepSeek-V3 runs the same kernels as the real checkpoint.

The values do not depend on tensor parallelism: each parameter's values are those of
its whole (TP 1) tensor, a pure function of (seed, parameter name, full shape), and a TP
(or EP, or DP-attention) rank keeps its slice of them (engine/weights/sharding.py's rules), so a TP run with dummy
weights computes what one process does. The whole tensor is drawn in blocks of rows
(about 2^24 elements each, one generator seeded from (seed, name, first row) per block):
no full-size temporary is ever allocated, and a rank that holds a row range of a tensor
only draws the blocks that overlap it.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from engine.distributed.groups import TPGroup
from engine.weights.sharding import SliceSpec, group_spec, is_scale, weight_name
from engine.weights.w4afp8 import int4_scale_block
from kernels.fp8_math import FP8_DTYPE

_CHUNK = 1 << 24  # elements generated at a time (rounded to whole rows)


def _seed(seed: int, name: str, row: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _transform(name: str, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, 1) samples -> this parameter's distribution."""
    if dtype == FP8_DTYPE:
        return lambda x: x
    if dtype == torch.int8:  # packed INT4 (W4AFP8 experts): bytes whose two nibbles span [-8, 7]
        return lambda x: (x * 48).round().clamp(-128, 127)
    if name.endswith("_scale") or name.endswith("weight_scale_inv"):
        return lambda x: 0.02 * (1 + 0.25 * x.abs())
    if "norm" in name:
        return lambda x: 1 + 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return lambda x: 0.01 * x
    return lambda x: 0.02 * x


def fill_slice(p: torch.Tensor, name: str, full_shape: Sequence[int], spec: Optional[SliceSpec], seed: int,
               fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Fill p with `spec`'s part (None: all) of the deterministic random tensor of `full_shape`."""
    full_shape = tuple(full_shape) or (1,)
    cols = full_shape[-1]
    rows = math.prod(full_shape[:-1])
    local = p.data.view(-1, p.shape[-1] if p.dim() else 1)
    col = slice(None)
    sel = None  # the full tensor's rows this rank holds, ascending (None: every row)
    if spec is not None and spec.dim == len(full_shape) - 1:
        (col,) = spec.index(cols)
    elif spec is not None:
        sel = spec.apply(torch.arange(rows).view(full_shape[:-1])).reshape(-1)
    per = max(1, _CHUNK // cols)
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        if sel is None:
            lo, hi = r0, r1
        else:
            lo, hi = (int(i) for i in torch.searchsorted(sel, torch.tensor([r0, r1])))
            if lo == hi:
                continue
        g = torch.Generator(device=p.device).manual_seed(_seed(seed, name, r0))
        block = torch.randn(r1 - r0, cols, generator=g, device=p.device)
        if sel is not None:
            block = block[(sel[lo:hi] - r0).to(p.device)]
        local[lo:hi] = fn(block[:, col]).to(p.dtype)


def fill_dummy(named_params: Iterable[tuple[str, torch.Tensor]], seed: int,
               full_shapes: Optional[Mapping[str, Sequence[int]]] = None, tp: Optional[TPGroup] = None,
               block: Optional[tuple[int, int]] = None, placed: Optional[Mapping[str, Sequence[int]]] = None) -> None:
    """Fill every parameter: norms ~1, FP8 weights ~N(0,1) with scales ~0.02, others ~N(0, 0.02).

    Under TP give `full_shapes` (each parameter's TP-1 shape, by name), this rank's `tp` group and
    the FP8 `block` of weights kept FP8: each parameter then gets its rank's slice of the TP-1 values.
    placed: under an expert placement, expert parameter name -> the logical expert of each local slot (each
    slot gets that expert's TP-1 values)."""
    split = tp is not None and tp.size > 1
    if split and full_shapes is None:
        raise ValueError("fill_dummy under TP needs the parameters' full (TP 1) shapes")
    named_params = list(named_params)
    int4 = {name for name, p in named_params if p.dtype == torch.int8}  # W4AFP8 experts: group scales
    for name, p in named_params:
        full = tuple(full_shapes[name]) if full_shapes is not None else tuple(p.shape)
        fn = _transform(name, p.dtype)
        blk = block
        if is_scale(name) and weight_name(name) in int4:
            fn = lambda x: 0.004 * (1 + 0.25 * x.abs())  # noqa: E731 - int4 x scale ~ the FP8 weights' spread
            if split:
                blk = int4_scale_block(full_shapes[weight_name(name)], full)
        if placed and name in placed:
            for j, expert in enumerate(placed[name]):
                fill_slice(p.data[j:j + 1], name, full, SliceSpec(0, expert, 1), seed, fn)
            continue
        spec = None
        if split:
            wshape = full_shapes[weight_name(name)] if is_scale(name) else None
            spec = group_spec(name, full, tp, blk, wshape)
        fill_slice(p, name, full, spec, seed, fn)
