"""Tree attention without a tree kernel: every tree node is one query row with its own KV index list.

A node at depth d of request r attends to r's cached prefix (its first m slots in the request table)
followed by the slots of its ancestors and itself (d + 1 slots for a verify node). `build_tree_table`
writes those lists as the rows of a scratch table shaped like the request table; a ForwardBatch in
DECODE mode whose `req_pool_indices` are the scratch rows and whose `seq_lens` are the list lengths
then runs tree attention through any attention backend's ordinary decode path (torch reference, the
Triton decode kernel, FlashInfer's page table), and positions are prefix + depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch, ForwardMode, tensor_to_device, to_device


@dataclass
class TreeTable:
    """Quacks like engine.memory.pools.ReqToTokenPool for the attention backends (read side only)."""
    table: torch.Tensor  # [rows, width] int32 KV slots

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end].to(torch.int64)


def build_tree_table(req_table: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extra: torch.Tensor, extra_lens: torch.Tensor, max_prefix: int) -> TreeTable:
    """Row i: req_table[req_rows[i], :prefix_lens[i]] then extra[i, :extra_lens[i]].

    All tensors on the table's device; req_rows / prefix_lens / extra_lens [R], extra [R, D]; max_prefix:
    the largest prefix length, from the host (reading it from the device would wait for the GPU). The
    width is max_prefix + D, so the copy is R x that (one step's nodes, not the whole context)."""
    dev = req_table.device
    rows = req_rows.numel()
    depth = extra.shape[1]
    width = (max_prefix if rows else 0) + depth
    base = torch.zeros(rows, width, dtype=req_table.dtype, device=dev)
    w = min(width, req_table.shape[1])
    if rows:
        base[:, :w] = req_table[:, :w][req_rows.to(dev, torch.int64)]
    pos = torch.arange(width, device=dev)[None, :] - prefix_lens.to(dev)[:, None]  # index into extra
    inside = (pos >= 0) & (pos < extra_lens.to(dev)[:, None])
    vals = extra.to(dev, req_table.dtype).gather(1, pos.clamp(0, max(depth - 1, 0)).expand(rows, width)) \
        if depth else base
    return TreeTable(torch.where(inside, vals, base))


def tree_batch(input_ids: torch.Tensor, positions: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor,
               device: torch.device, max_position: int) -> ForwardBatch:
    """A DECODE-mode batch over scratch-table rows 0..R-1 (one query row per tree node).

    positions: each row's position (clamped to max_position: rows past the context limit are computed
    but never accepted); seq_lens: its KV list length. The host columns go to the device in one copy."""
    n = len(seq_lens)
    prefix = [s - 1 for s in seq_lens]
    rows = list(range(n))
    cols = to_device([min(p, max_position) for p in positions] + rows + list(seq_lens) + [1] * n + prefix,
                     device).view(5, n)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=input_ids.to(device, torch.int64), positions=cols[0],
        req_pool_indices=cols[1], seq_lens=cols[2],
        out_cache_loc=tensor_to_device(out_cache_loc.to(torch.int64), device),
        extend_lens=cols[3], prefix_lens=cols[4], logits_indices=cols[1], seq_lens_cpu=list(seq_lens),
        extend_lens_cpu=[1] * n, prefix_lens_cpu=prefix)
