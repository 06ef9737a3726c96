"""moe_align_block_size: sort token->expert assignments into block-aligned segments.

The fused-MoE GEMMs work on blocks of BLOCK_M rows that all belong to one expert.
Given topk_ids [T, top_k], this lays out the T*top_k assignment indices
(flat index t * top_k + slot) grouped by expert, each expert's segment padded to a
multiple of block_m with the sentinel T*top_k:

  sorted_ids   [max_blocks * block_m] int32   assignment index per row (sentinel = padding)
  expert_ids   [max_blocks] int32             expert of each block (-1 past the end)
  num_post_pad [1] int32                      rows in use (sum of padded segment sizes)

Within an expert, assignments keep their flat order (stable), so the layout is
deterministic. Ids outside [0, E) (experts of another EP rank) are left out.
Sizes depend only on (T, top_k, E, block_m), never on the routing, so the launches
are CUDA-graph safe and need no host sync. Large inputs take three launches:
  1. per chunk of assignments, a histogram over experts;
  2. one program: per-chunk exclusive prefixes + expert offsets, block->expert map,
     sentinel fill;
  3. per chunk, rank within (chunk, expert) by a one-hot cumulative sum, scatter.
Up to SMALL_CHUNKS chunks (decode batches) one program does all of it in one launch
(`align_small`, which the fused-MoE prologue also runs beside the activation quantisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enter

SMALL_CHUNKS = 8  # up to this many chunks, one program does all passes (one launch)


@dataclass
class MoEAlignment:
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post_pad: torch.Tensor
    block_m: int


def max_blocks(numel: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of non-empty blocks: sum_e ceil(c_e / bm) <= numel // bm + min(E, numel)."""
    return numel // block_m + min(num_experts, numel)


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> MoEAlignment:
    """Pure-torch reference (stable sort), same layout as `moe_align_block_size`."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    nb = max_blocks(numel, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.full((nb * block_m,), numel, dtype=torch.int32, device=dev)
    expert_ids = torch.full((nb,), -1, dtype=torch.int32, device=dev)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    pos = 0
    for e in range(num_experts):
        idx = torch.nonzero(flat == e).flatten()
        s = int(starts[e])
        sorted_ids[s:s + idx.numel()] = idx.to(torch.int32)
        expert_ids[s // block_m:(s + int(padded[e])) // block_m] = e
        pos = s + int(padded[e])
    return MoEAlignment(sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32, device=dev), block_m)


@triton.jit
def _onehot(ids_ptr, chunk, numel, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + idx, mask=idx < numel, other=-1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    hot = (ids[:, None] == e[None, :]) & (e[None, :] < E)
    return idx, ids, hot.to(tl.int32)


@triton.jit
def _layout_blocks(counts, sorted_ids_ptr, expert_ids_ptr, npp_ptr, E, numel, n_blocks,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, FILL: tl.constexpr):
    """Per-expert counts -> segment starts (returned); writes num_post_pad, the block->expert
    map and the sentinel into every row."""
    e = tl.arange(0, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    total = tl.sum(padded, axis=0)
    tl.store(npp_ptr, total)
    end = tl.where(e < E, end, 2147483647)
    for b0 in range(0, n_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        row = b * BLOCK_M
        owner = tl.sum((end[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(row < total, owner, -1), mask=b < n_blocks)
    for i0 in range(0, n_blocks * BLOCK_M, FILL):
        i = i0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + i, tl.full((FILL,), 0, tl.int32) + numel, mask=i < n_blocks * BLOCK_M)
    return start


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, numel, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_enter(PDL)
    chunk = tl.program_id(0)
    _, _, hot = _onehot(ids_ptr, chunk, numel, E, CHUNK, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + chunk * E + e, tl.sum(hot, axis=0), mask=e < E)


@triton.jit
def _align_scan_kernel(hist_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                       FILL: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr = False):
    """hist [n_chunks, E] -> base row of each (chunk, expert), SCAN chunks per step."""
    pdl_enter(PDL)
    e = tl.arange(0, BLOCK_E)
    e_mask = (e < E)[None, :]
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, n_chunks, SCAN):  # exclusive prefix over chunks, per expert
        c = c0 + tl.arange(0, SCAN)
        ptrs = hist_ptr + c[:, None] * E + e[None, :]
        mask = (c < n_chunks)[:, None] & e_mask
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + running[None, :], mask=mask)
        running += tl.sum(h, axis=0)
    start = _layout_blocks(running, sorted_ids_ptr, expert_ids_ptr, npp_ptr, E, numel, n_blocks,
                           BLOCK_M, BLOCK_E, BLOCK_B, FILL)
    for c0 in range(0, n_chunks, SCAN):  # + segment start of the expert
        c = c0 + tl.arange(0, SCAN)
        ptrs = hist_ptr + c[:, None] * E + e[None, :]
        mask = (c < n_chunks)[:, None] & e_mask
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0) + start[None, :], mask=mask)


@triton.jit
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ids_ptr, numel, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_enter(PDL)
    chunk = tl.program_id(0)
    idx, ids, hot = _onehot(ids_ptr, chunk, numel, E, CHUNK, BLOCK_E)
    rank = tl.sum(hot * tl.cumsum(hot, axis=0), axis=1) - 1  # earlier same-expert entries in this chunk
    valid = (ids >= 0) & (ids < E) & (idx < numel)
    base = tl.load(base_ptr + chunk * E + ids, mask=valid, other=0)
    tl.store(sorted_ids_ptr + base + rank, idx, mask=valid)


@triton.jit
def align_small(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_B: tl.constexpr, FILL: tl.constexpr):
    """All passes in one program (few assignments). Also called from the fused-MoE prologue."""
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, n_chunks):
        _, _, hot = _onehot(ids_ptr, c, numel, E, CHUNK, BLOCK_E)
        counts += tl.sum(hot, axis=0)
    running = _layout_blocks(counts, sorted_ids_ptr, expert_ids_ptr, npp_ptr, E, numel, n_blocks,
                             BLOCK_M, BLOCK_E, BLOCK_B, FILL)
    tl.debug_barrier()  # the sentinel fill above and the scatter below may touch the same rows
    for c in range(0, n_chunks):
        idx, ids, hot = _onehot(ids_ptr, c, numel, E, CHUNK, BLOCK_E)
        dest = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + running[None, :]), axis=1)
        tl.store(sorted_ids_ptr + dest, idx, mask=(ids >= 0) & (ids < E) & (idx < numel))
        running += tl.sum(hot, axis=0)


@triton.jit
def _align_small_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                        CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_B: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    align_small(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                CHUNK, BLOCK_M, BLOCK_E, BLOCK_B, FILL)


@dataclass
class AlignPlan:
    """Buffer sizes and launch shape of one alignment (they depend on sizes, not on routing)."""
    numel: int
    num_experts: int
    block_m: int
    chunk: int
    n_chunks: int
    block_e: int
    n_blocks: int

    @property
    def small(self) -> bool:
        return self.n_chunks <= SMALL_CHUNKS

    def meta(self) -> dict:
        """Constexprs of `align_small`."""
        return dict(CHUNK=self.chunk, BLOCK_M=self.block_m, BLOCK_E=self.block_e,
                    BLOCK_B=max(16, 4096 // self.block_e), FILL=1024)

    def empty(self, device) -> MoEAlignment:
        return MoEAlignment(torch.empty((self.n_blocks * self.block_m,), dtype=torch.int32, device=device),
                            torch.empty((self.n_blocks,), dtype=torch.int32, device=device),
                            torch.empty((1,), dtype=torch.int32, device=device), self.block_m)


def align_plan(numel: int, num_experts: int, block_m: int, chunk: Optional[int] = None) -> AlignPlan:
    block_e = triton.next_power_of_2(max(num_experts, 1))
    chunk = chunk or max(16, min(triton.next_power_of_2(max(numel, 1)), 8192 // block_e))
    return AlignPlan(numel, num_experts, block_m, chunk, triton.cdiv(numel, chunk), block_e,
                     max_blocks(numel, num_experts, block_m))


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         chunk: Optional[int] = None) -> MoEAlignment:
    """topk_ids [T, top_k] (any int dtype) -> MoEAlignment (see the module docstring).

    `chunk` (power of two >= 16) is the assignments per program of the count/scatter passes.
    """
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    plan = align_plan(flat.numel(), num_experts, block_m, chunk)
    al = plan.empty(topk_ids.device)
    args = (al.sorted_ids, al.expert_ids, al.num_post_pad, plan.n_chunks, num_experts, plan.numel, plan.n_blocks)
    if plan.small:
        _align_small_kernel[(1,)](flat, *args, **plan.meta(), num_warps=4, **launch_options())
        return al
    hist = torch.empty((plan.n_chunks, num_experts), dtype=torch.int32, device=flat.device)
    _align_count_kernel[(plan.n_chunks,)](flat, hist, plan.numel, num_experts, CHUNK=plan.chunk,
                                          BLOCK_E=plan.block_e, num_warps=4, **launch_options())
    meta = plan.meta()
    meta.pop("CHUNK")
    _align_scan_kernel[(1,)](hist, *args, **meta, SCAN=max(1, 8192 // plan.block_e), num_warps=8, **launch_options())
    _align_scatter_kernel[(plan.n_chunks,)](flat, hist, al.sorted_ids, plan.numel, num_experts, CHUNK=plan.chunk,
                                            BLOCK_E=plan.block_e, num_warps=4, **launch_options())
    return al
