"""The custom all-reduce's layout and index math, and pure-torch references of its two algorithms (no Triton:
the CPU paths and the gloo tests import this alone). kernels/all_reduce.py's kernels follow it: every rank's
buffer starts with `flag_slots(programs)` int64 flags ([PHASES][programs][MAX_RANKS]); two-shot cuts n
elements into one chunk per rank (`chunk_elems`, whole tiles of `block`, the last chunk shorter). Both
references sum in float32 in rank order and round once, as the kernels do, so every rank gets the same bits.
"""

from __future__ import annotations

import torch

MAX_RANKS = 8  # flag slots per (phase, program): one per possible rank
PHASES = 2  # flag arrays: the first barrier, and two-shot's second
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def flag_slots(programs: int) -> int:
    """int64 flags at the start of every rank's buffer: [PHASES][programs][MAX_RANKS]."""
    return PHASES * programs * MAX_RANKS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_elems(n: int, world: int, block: int) -> int:
    """Two-shot chunk length: n / world rounded up to whole tiles of `block` elements."""
    return _cdiv(_cdiv(n, world), block) * block


def chunk_bounds(n: int, world: int, block: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's chunk of n elements (empty past the end of a short tensor)."""
    c = chunk_elems(n, world, block)
    return min(rank * c, n), min((rank + 1) * c, n)


# ---- pure-torch references ---------------------------------------------------------------------

def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rank-order float32 sum rounded once to the inputs' dtype (what both kernels compute)."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def one_shot_reference(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank reads every rank's whole input and sums: each rank's output."""
    flat = [x.reshape(-1) for x in inputs]
    return [_sum(flat).view_as(x) for x in inputs]


def two_shot_reference(inputs: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """Reduce-scatter (rank r sums chunk r of every input) then all-gather (every rank copies chunk q from
    rank q): each rank's output."""
    world, n = len(inputs), inputs[0].numel()
    flat = [x.reshape(-1) for x in inputs]
    bounds = [chunk_bounds(n, world, block, r) for r in range(world)]
    reduced = [_sum([f[s:e] for f in flat]) for s, e in bounds]  # rank r's reduce-scatter result
    outs = []
    for x in inputs:
        out = torch.empty_like(flat[0])
        for (s, e), part in zip(bounds, reduced):
            out[s:e] = part
        outs.append(out.view_as(x))
    return outs
