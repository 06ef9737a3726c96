"""Split-K for weight-streaming GEMMs at decode sizes: how many parts, the arrival counts, the in-kernel sum.

At batch 1 a GEMM reads its weights once; a launch with a few dozen output tiles on a 132-SM GPU leaves most
SMs idle while one program per tile walks all of K. Split-K gives program (tile, s) the s-th contiguous run of
K blocks; each part is stored to a float32 slot of a scratch buffer, and the last program of the tile to arrive
(an atomic count per tile) adds the slots in split order 0..SPLIT_K-1, so the sum is the same whichever program
finished last, and sets the count back to 0 for the next launch or CUDA-graph replay. Used by the block-FP8
GEMM (kernels/fp8.py) and the fused MoE (kernels/fused_moe.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

SPLIT_K_MIN_BLOCKS = 4  # K blocks each part sums at least
SPLIT_K_PROGRAMS_PER_SM = 2  # the automatic split aims at this many programs per SM
COUNT_SLOTS = 4096  # tiles one split launch may have (one arrival count per tile)
_arrival_counts: dict = {}  # device -> int32 zeros, COUNT_SLOTS of them; each launch leaves them at 0


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(tiles: int, k_blocks: int, device: torch.device, cfg: dict) -> int:
    """How many parts the K loop of a launch with `tiles` output tiles is split into: the config's SPLIT_K when
    it has one (a tuned file's), else, on a GPU, enough parts for about SPLIT_K_PROGRAMS_PER_SM programs per SM,
    each summing at least SPLIT_K_MIN_BLOCKS K blocks. 1 (no split) on CPU or past COUNT_SLOTS tiles."""
    if tiles > COUNT_SLOTS:
        return 1
    if "SPLIT_K" in cfg:
        return max(1, min(int(cfg["SPLIT_K"]), k_blocks))
    if device.type != "cuda":
        return 1
    want = triton.cdiv(SPLIT_K_PROGRAMS_PER_SM * sm_count(device), max(tiles, 1))
    return max(1, min(want, k_blocks // SPLIT_K_MIN_BLOCKS))


def plan(tiles: int, k_blocks: int, cfg: dict, block_m: int, block_n: int, out: torch.Tensor,
         slots_per_part: int = 1) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split, scratch, arrival counts) of one launch (`split_k_for`): the float32 slots for `slots_per_part`
    partial tiles per part (the gated MoE keeps gate and up) and the device's counts; without a split both are
    `out`, which the kernel then never reads as such."""
    split = split_k_for(tiles, k_blocks, out.device, cfg)
    if split == 1:
        return 1, out, out
    return split, scratch(tiles, split * slots_per_part, block_m, block_n, out.device), arrivals(out.device)


def arrivals(device: torch.device) -> torch.Tensor:
    """The device's arrival counts (zeros between launches)."""
    counts = _arrival_counts.get(device)
    if counts is None:
        counts = _arrival_counts[device] = torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=device)
    return counts


def scratch(tiles: int, parts: int, block_m: int, block_n: int, device: torch.device) -> torch.Tensor:
    """Float32 slots for `parts` partial tiles of each of `tiles` tiles."""
    return torch.empty(tiles * parts * block_m * block_n, dtype=torch.float32, device=device)


@triton.jit
def k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, split):
    """[first, end) of the K blocks part `split` of SPLIT_K sums (contiguous runs; the last may be short or
    empty)."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    k_first = split * per_split
    return k_first, tl.minimum(k_first + per_split, k_blocks)


@triton.jit
def tile_slots(ws_ptr, tile, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to slot 0 of `tile`'s SLOTS slots (slot j is + j * BLOCK_M * BLOCK_N)."""
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return ws_ptr + tile.to(tl.int64) * (SLOTS * BLOCK_M * BLOCK_N) + local


@triton.jit
def arrive(count_ptr, tile, SPLIT_K: tl.constexpr):
    """Count this program's part of `tile` in (after its slots are written); True for the last one, which
    also sets the count back to 0 (every part has arrived)."""
    tl.debug_barrier()  # every thread's slot values are written before the count says so
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = done == SPLIT_K - 1
    if last:
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def sum_slots(slots, first, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slots first, first + 1, ..., first + SPLIT_K - 1 of a tile added in that order (L2 reads: other SMs
    wrote them)."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(slots + (first + s) * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
    return total
