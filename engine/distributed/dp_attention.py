"""DP attention: the per-forward gather / scatter of hidden states around every dense MLP and MoE.

With `--enable-dp-attention --dp N` the `tp` ranks form N DP groups of tp / N consecutive ranks.
Each group runs its own scheduler, so its batch (T_g tokens) differs from the others'. Attention
runs inside the group; every MLP / MoE runs over all tp ranks on the tokens of every group:

    group g's ranks, T_g tokens each            every rank
    x[T_g] --pad to max T--> all_gather_rows --> [tp x max T] --keep one copy per group, unpad-->
    [T_0 + T_1 + ...]  --MLP / MoE split over all ranks, one all-reduce-->  [sum T]  --rows of g--> x[T_g]

Ranks of one DP group hold the same tokens, so of the tp gathered blocks only each group's first
rank's is kept (at dp = tp, the usual layout, nothing is gathered twice). After the MLP's
all-reduce every rank holds every token's output and keeps its own group's rows.

The counts are exchanged once per forward on the host (`exchange_counts`: an all-gather of each
rank's token count over the gloo group), before any layer runs; a group with no work joins with 0
tokens and runs an idle forward (engine/runner.py), so every rank runs the same collectives.

CUDA graphs: when every group runs a decode batch (or nothing) that fits a captured size, all groups
replay the graph of one padded size, captured with a `uniform` gather (every group at that width,
padding rows included): the gather's shapes are then static and its all-gather is recorded in the
graph. An idle group replays it too, with padding rows only. Any group in an extend (or too large a
batch) sends every group down the eager path with exact counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.distributed import comm
from engine.distributed.groups import TPGroup


@dataclass
class DPGather:
    """One forward's DP layout: the whole group, and the tokens of each DP group."""

    group: TPGroup  # the model's (world) group, with dp_size / dp_rank set
    counts: list[int]  # tokens of each DP group in this forward

    @property
    def total(self) -> int:
        return sum(self.counts)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        """This group's rows [T_g, H] -> every group's rows [sum T, H], group order."""
        width = max(self.counts)
        padded = h.new_zeros((width, *h.shape[1:]))
        padded[: h.shape[0]] = h
        every = comm.all_gather_rows(padded, self.group)
        per_group = self.group.size // self.group.dp_size
        starts = (g * per_group * width for g in range(self.group.dp_size))
        return torch.cat([every[s: s + n] for s, n in zip(starts, self.counts)])

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        """Every group's rows (already summed over all ranks) -> this group's rows."""
        start = sum(self.counts[: self.group.dp_rank])
        return out[start: start + self.counts[self.group.dp_rank]]


def uniform(group: TPGroup, width: int) -> DPGather:
    """Every DP group at the same padded width (a CUDA graph's batch size): static shapes, so the gather
    can be captured; padding rows are computed like real ones and dropped by their group."""
    return DPGather(group, [width] * group.dp_size)


def exchange_counts(tokens: int, group: TPGroup, graph_sizes: Sequence[int] = (),
                    graphable: bool = False) -> tuple[DPGather, Optional[int]]:
    """Agree on the forward about to run (host collective): every DP group's token count, and whether
    all of them replay CUDA graphs of one padded size. They do when every group's batch is a decode
    batch a graph can run (`graphable`) or empty, and one is not: then the size is the smallest of
    `graph_sizes` (the captured sizes, the same on every rank) that holds the largest group's batch,
    and the returned gather is `uniform` at that size. Otherwise (None) each group runs eagerly with
    its own count."""
    every = comm.all_gather_ints(2 * tokens + int(graphable or tokens == 0), group)
    per_group = group.size // group.dp_size
    firsts = [every[g * per_group] for g in range(group.dp_size)]
    counts = [v // 2 for v in firsts]
    widest = max(counts)
    if graph_sizes and all(v % 2 for v in firsts) and 0 < widest <= max(graph_sizes):
        bs = min(s for s in graph_sizes if s >= widest)
        return uniform(group, bs), bs
    return DPGather(group, counts), None
