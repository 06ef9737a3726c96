"""All-reduce (sum) between the GPUs of one node through peer memory: the one-shot and two-shot Triton
kernels. Their layout, chunk math and pure-torch references are kernels/all_reduce_ref.py's.

Every rank owns one peer-visible buffer (CUDA IPC, engine/distributed/custom_all_reduce.py) laid out as
`flag_slots(programs)` int64 flags, then two data halves of `half_elems` elements each. A kernel gets the
addresses of every rank's data base and flag base as two int64 tensors (`buf_ptrs`, `flag_ptrs`, rank
order), plus a local int64 counter per program that the kernel advances (device state, so CUDA-graph
replays advance it too).

One call, program b of rank r, with k = counter[b] (equal on every rank and every program: each call runs
the same fixed grid of `programs` programs everywhere):
- data half h = k % 2 (double buffering: a rank overwrites half h only two calls later, when every peer has
  entered the call in between and so has finished reading half h);
- copy its tiles of x into its own buffer's half h (the input is staged inside the kernel: no separate
  copy, no registered graph buffers);
- barrier: write k + 1 into slot [phase][b][r] of every rank's flags (system-scope release, after a block
  barrier), then spin until slots [phase][b][q] of its own flags hold >= k + 1 for every rank q
  (system-scope acquire); a peer already one call ahead has written k + 2, hence ">=";
- one-shot: sum its tiles of every rank's half h in float32 (rank order 0..W-1, so every rank gets the
  same bits), round once, write x in place;
- two-shot: reduce-scatter, then all-gather. x is cut into W chunks of `chunk` elements (a multiple of
  BLOCK, the last one shorter); rank r sums chunk r of every rank's buffer and writes the sum into its own
  chunk r (only rank r reads its own chunk r in the first phase) and into x; a second barrier (phase 1);
  then it copies chunk q of rank q's buffer into x for every q != r;
  peers' data is loaded with ".cg" (L2, not the incoherent L1);
- counter[b] = k + 1.
Program b handles tiles b, b + programs, ... of [0, n) (one-shot) or of every chunk (two-shot), the same
tiles in every phase, so a per-program barrier suffices: program b only reads what programs b of the
peers wrote. Every program must be resident at once (programs <= SMs, nothing else hogging the GPU), as
in any kernel that spins on its peers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.all_reduce_ref import MAX_RANKS, SUPPORTED_DTYPES, chunk_elems
from kernels.interpret import interpreting
from kernels.rms_norm import round_to

_MAX_RANKS = tl.constexpr(MAX_RANKS)


# ---- kernels -------------------------------------------------------------------------------------

@triton.jit
def _peer(ptrs, i, dtype: tl.constexpr):
    """Rank i's data base (an address in an int64 tensor) as a pointer; the buffers are 256-byte aligned."""
    return tl.multiple_of(tl.load(ptrs + i).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _barrier(flag_ptrs, rank, slot, value, W: tl.constexpr):
    """Tell every rank that this program reached `slot` of call `value`, then wait for every rank's word."""
    tl.debug_barrier()  # this program's writes before the release below
    for p in tl.static_range(W):
        peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer + slot * _MAX_RANKS + rank, value, sem="release", scope="sys")
    own = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(W):
        seen = tl.atomic_add(own + slot * _MAX_RANKS + q, 0, sem="acquire", scope="sys")
        while seen < value:
            seen = tl.atomic_add(own + slot * _MAX_RANKS + q, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # every thread reads peers' data only after the acquire


@triton.jit
def _sum_peers(buf_ptrs, half, offs, mask, dtype: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
               EXACT_ROUND: tl.constexpr):
    """The sum over every rank's staged copy of elements `offs` (fp32, rank order), rounded to `dtype`."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(W):
        src = _peer(buf_ptrs, p, dtype)
        acc += tl.load(src + half + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return round_to(acc, dtype, EXACT_ROUND)


@triton.jit
def _one_shot_kernel(x_ptr, buf_ptrs, flag_ptrs, counter_ptr, n, half_elems, rank,
                     W: tl.constexpr, BLOCK: tl.constexpr, EXACT_ROUND: tl.constexpr):
    b = tl.program_id(0)
    programs = tl.num_programs(0)
    k = tl.load(counter_ptr + b)
    half = tl.multiple_of((k % 2) * half_elems, 16)  # half_elems is a multiple of 16 (the launcher's)
    dtype = x_ptr.dtype.element_ty
    own = _peer(buf_ptrs, rank, dtype)
    tiles = tl.cdiv(n, BLOCK)
    for t in range(b, tiles, programs):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(own + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(flag_ptrs, rank, b, k + 1, W)
    for t in range(b, tiles, programs):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, _sum_peers(buf_ptrs, half, offs, mask, dtype, W, BLOCK, EXACT_ROUND), mask=mask)
    tl.store(counter_ptr + b, k + 1)


@triton.jit
def _two_shot_kernel(x_ptr, buf_ptrs, flag_ptrs, counter_ptr, n, chunk, half_elems, rank,
                     W: tl.constexpr, BLOCK: tl.constexpr, EXACT_ROUND: tl.constexpr):
    b = tl.program_id(0)
    programs = tl.num_programs(0)
    k = tl.load(counter_ptr + b)
    half = tl.multiple_of((k % 2) * half_elems, 16)  # half_elems is a multiple of 16 (the launcher's)
    dtype = x_ptr.dtype.element_ty
    own = _peer(buf_ptrs, rank, dtype)
    tiles = chunk // BLOCK  # per chunk
    for q in tl.static_range(W):  # stage this program's tiles of every chunk
        for t in range(b, tiles, programs):
            offs = q * chunk + t * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(own + half + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _barrier(flag_ptrs, rank, b, k + 1, W)
    for t in range(b, tiles, programs):  # reduce-scatter: this rank's chunk
        offs = rank * chunk + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        out = _sum_peers(buf_ptrs, half, offs, mask, dtype, W, BLOCK, EXACT_ROUND)
        tl.store(own + half + offs, out, mask=mask)
        tl.store(x_ptr + offs, out, mask=mask)
    _barrier(flag_ptrs, rank, programs + b, k + 1, W)
    for q in tl.static_range(W):  # all-gather: chunk q from rank q
        if q != rank:
            src = _peer(buf_ptrs, q, dtype)
            for t in range(b, tiles, programs):
                offs = q * chunk + t * BLOCK + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(x_ptr + offs, tl.load(src + half + offs, mask=mask, cache_modifier=".cg"), mask=mask)
    tl.store(counter_ptr + b, k + 1)


def all_reduce_one_shot(x: torch.Tensor, buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counters: torch.Tensor,
                        rank: int, half_elems: int, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Sum x (contiguous) over the ranks of `buf_ptrs` in place, one-shot; one program per counter."""
    _check(x, buf_ptrs, half_elems)
    _one_shot_kernel[(counters.numel(),)](x, buf_ptrs, flag_ptrs, counters, x.numel(), half_elems, rank,
                                          W=buf_ptrs.numel(), BLOCK=block, EXACT_ROUND=interpreting(),
                                          num_warps=num_warps)
    return x


def all_reduce_two_shot(x: torch.Tensor, buf_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counters: torch.Tensor,
                        rank: int, half_elems: int, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Sum x (contiguous) over the ranks of `buf_ptrs` in place, reduce-scatter + all-gather."""
    _check(x, buf_ptrs, half_elems)
    world = buf_ptrs.numel()
    _two_shot_kernel[(counters.numel(),)](x, buf_ptrs, flag_ptrs, counters, x.numel(),
                                          chunk_elems(x.numel(), world, block), half_elems, rank,
                                          W=world, BLOCK=block, EXACT_ROUND=interpreting(), num_warps=num_warps)
    return x


def _check(x: torch.Tensor, buf_ptrs: torch.Tensor, half_elems: int) -> None:
    if not x.is_contiguous() or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"all-reduce kernels take contiguous {SUPPORTED_DTYPES} tensors (got {x.dtype}, "
                         f"contiguous={x.is_contiguous()})")
    if x.numel() > half_elems or half_elems % 16 or not 1 < buf_ptrs.numel() <= MAX_RANKS:
        raise ValueError(f"{x.numel()} elements over {buf_ptrs.numel()} ranks do not fit halves of {half_elems} "
                         "elements (a multiple of 16)")
