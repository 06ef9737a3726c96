"""Tree attention without a tree kernel: every tree node is one query row with its own KV index list.

A node at depth d of request r attends to r's cached prefix (its first m slots in the request table)
followed by the slots of its ancestors and itself (d + 1 slots for a verify node). `build_tree_table`
writes those lists as the rows of a scratch table shaped like the request table; a ForwardBatch in
DECODE mode (`tree_batch`) whose `req_pool_indices` are the scratch rows and whose `seq_lens` are the
list lengths then runs tree attention through any attention backend's ordinary decode path (torch
reference, the Triton decode kernel, FlashInfer's page table), and positions are prefix + depth.
`ancestors` gives every node's path from the root with tensor ops on the packed tree (no host loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.speculative.step_batch import RowIndex


@dataclass
class TreeTable:
    """Quacks like engine.memory.pools.ReqToTokenPool for the attention backends (read side only)."""
    table: torch.Tensor  # [rows, width] int32 KV slots

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end].to(torch.int64)


def build_tree_table(req_table: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extra: torch.Tensor, max_prefix: int) -> TreeTable:
    """Row i: req_table[req_rows[i], :prefix_lens[i]] then extra[i] (its first seq_len - prefix_len entries
    are row i's list; what lies past a row's sequence length is never read).

    All tensors on the table's device; req_rows / prefix_lens [R], extra [R, D]; max_prefix: the largest
    prefix length, from the host (reading it from the device would wait for the GPU). The width is
    max_prefix + D, so the copy is R x that (one step's nodes, not the whole context)."""
    rows, depth = extra.shape
    width = (max_prefix if rows else 0) + depth
    if width <= req_table.shape[1]:
        table = req_table[req_rows, :width]
    else:  # only the first max_prefix entries of a row can be prefix
        table = torch.zeros(rows, width, dtype=req_table.dtype, device=req_table.device)
        table[:, :req_table.shape[1]] = req_table[req_rows]
    if depth:
        cols = prefix_lens[:, None] + torch.arange(depth, device=req_table.device)
        table.scatter_(1, cols, extra.to(table.dtype))
    return TreeTable(table)


def ancestors(parents: torch.Tensor, depths: torch.Tensor, node_ids: torch.Tensor,
              levels: torch.Tensor) -> torch.Tensor:
    """[B, N, S + 1]: column d of node j is j's ancestor at depth d, for d up to j's depth (so j itself
    there), then j again. parents [B, N] (-1 at the root; parents precede children), depths [B, N];
    node_ids [B, N] (0..N-1 per row); levels [S + 1] (0..S, S >= every depth). S gathers, no host sync."""
    par = parents.clamp(min=0)  # the root is its own parent here
    up = [node_ids]
    for _ in range(levels.numel() - 1):
        up.append(par.gather(1, up[-1]))
    up = torch.stack(up, -1)  # [B, N, S + 1]: column k is the k-th ancestor (the root once past it)
    return up.gather(2, (depths[..., None] - levels).clamp(min=0))


def tree_batch(input_ids: torch.Tensor, prefix_lens: torch.Tensor, out_cache_loc: torch.Tensor,
               host_seq_lens: list[int], index: RowIndex, max_position: int, host_max_prefix: int,
               req_rows: Optional[torch.Tensor] = None, spec_hidden: Optional[torch.Tensor] = None,
               host_rows: Optional[list[int]] = None) -> ForwardBatch:
    """A DECODE-mode batch with one query row per tree node (or pending position), all tensors on the device.

    prefix_lens [R]: each row's position (the KV list holds prefix_len + 1 entries; positions are clamped
    to max_position where host_max_prefix, the largest prefix_len, exceeds it: rows past the context limit
    are computed but never accepted); host_seq_lens: the list lengths on the host (FlashInfer plans from
    them, the torch backend loops over them); index: rows 0..R-1 and ones; req_rows: the table rows
    (default: scratch-table rows 0..R-1), host_rows the same on the host where the caller has them."""
    positions = prefix_lens if host_max_prefix <= max_position else prefix_lens.clamp(max=max_position)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=input_ids, positions=positions,
        req_pool_indices=index.rows if req_rows is None else req_rows, seq_lens=prefix_lens + 1,
        out_cache_loc=out_cache_loc, extend_lens=index.ones, prefix_lens=prefix_lens, logits_indices=index.rows,
        seq_lens_cpu=host_seq_lens, extend_lens_cpu=[1] * len(host_seq_lens),
        prefix_lens_cpu=[s - 1 for s in host_seq_lens], spec_hidden=spec_hidden, req_rows_cpu=host_rows)
