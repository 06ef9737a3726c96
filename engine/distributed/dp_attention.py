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

The counts are exchanged once per forward on the host (`agree`: an all-gather of each rank's next
forward, kind and token count, over the gloo group), before any layer runs. A group whose next forward
is of another kind, or that has no work left in this iteration, joins with 0 tokens and runs an idle
forward of the agreed kind (dp_sync.py), so every rank runs the same collectives in the same order; the
iteration ends when every rank has nothing left (engine/runtime/rank_loop.py).

CUDA graphs: when every group runs a decode batch (or nothing) that fits a captured size, all groups
replay the graph of one padded size, captured with a `uniform` gather (every group at that width,
padding rows included): the gather's shapes are then static and its all-gather is recorded in the
graph. An idle group replays it too, with padding rows only. When a group extends (a prefill chunk or
a mixed step) and every group's batch fits a piecewise graph bucket (engine/runner/piecewise_graph.py),
all groups replay the piecewise chain of one bucket, the smallest that holds the widest group, again
with a `uniform` gather: each group attends its own batch (extend or decode) between the pieces, and an
idle group replays the pieces on padding rows. Anything larger sends every group down the eager path
with exact counts.

Two-batch overlap (engine/model/two_batch.py): each rank also offers how many of its tokens its first
micro-batch holds (`split`, 0 for a forward it does not split); the gather then knows every group's two
micro-batches (`splits`) and `halves` gives each its own gather. A CUDA graph's uniform gather splits every
group's padded batch at the same row.
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
    splits: Optional[list[int]] = None  # two-batch overlap: tokens of each group's first micro-batch

    @property
    def total(self) -> int:
        return sum(self.counts)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        """This group's rows [T_g, H] -> every group's rows [sum T, H], group order."""
        return self._keep(comm.all_gather_padded_rows(h, max(self.counts), self.group))

    def start_gather(self, h: torch.Tensor) -> comm.Pending:
        """`gather`, started asynchronously (two-batch overlap)."""
        return comm.start_all_gather_padded_rows(h, max(self.counts), self.group).map(self._keep)

    def _keep(self, every: torch.Tensor) -> torch.Tensor:
        """The gathered blocks (every rank's, padded to the widest group) -> each group's real rows, once."""
        width = max(self.counts)
        per_group = self.group.size // self.group.dp_size
        starts = (g * per_group * width for g in range(self.group.dp_size))
        return torch.cat([every[s: s + n] for s, n in zip(starts, self.counts)])

    def halves(self) -> tuple["DPGather", "DPGather"]:
        """The gathers of the two micro-batches (`splits` set)."""
        return (DPGather(self.group, list(self.splits)),
                DPGather(self.group, [n - s for n, s in zip(self.counts, self.splits)]))

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        """Every group's rows (already summed over all ranks) -> this group's rows."""
        start = sum(self.counts[: self.group.dp_rank])
        return out[start: start + self.counts[self.group.dp_rank]]


def uniform(group: TPGroup, width: int) -> DPGather:
    """Every DP group at the same padded width (a CUDA graph's batch size): static shapes, so the gather
    can be captured; padding rows are computed like real ones and dropped by their group. Two-batch overlap
    splits each group's padded batch after its first ceil(width / 2) rows."""
    return DPGather(group, [width] * group.dp_size, [(width + 1) // 2] * group.dp_size)


# What a rank's next forward runs, in the order the groups take them when they differ (see `agree`).
MTP, TARGET, DONE = 0, 1, 2
# one int per rank: kind << 60 | first micro-batch's tokens << 30 | tokens << 2 | piecewise << 1 | graphable
_KIND_SHIFT, _SPLIT_SHIFT, _TOKEN_SHIFT, _TOKEN_BITS = 60, 30, 2, 28


@dataclass
class Agreement:
    """The forward every rank runs next: its kind (MTP / TARGET; DONE: none, the iteration is over), the
    gather of each group's tokens (0 for a group whose own next forward is of another kind), the padded
    CUDA-graph size every group replays (None: not the decode graphs) and the token bucket of the piecewise
    graphs every group replays (None: not those; both None: eager)."""

    kind: int
    gather: DPGather
    graph_bs: Optional[int]
    piecewise_bs: Optional[int] = None
    real: Optional[list[int]] = None  # each group's own tokens (a padded forward pads them to one width)


def agree(kind: int, tokens: int, group: TPGroup, graph_sizes: Sequence[int] = (),
          graphable: bool = False, split: int = 0, piecewise_sizes: Sequence[int] = (),
          piecewise: bool = False) -> Agreement:
    """Agree on the next forward (host collective). Each rank offers the kind of its own next forward and
    its tokens; the smallest kind offered runs, with every group whose next forward is of that kind
    contributing its tokens and the others joining with none (an idle forward of that kind; they offer
    their own again afterwards). Every rank thus runs the same forwards in the same order, whatever mix
    of steps the groups are in (a speculative step runs several MTP forwards before its target forward),
    and the iteration ends when every rank offers DONE.

    The groups replay CUDA graphs of one padded size when the forward is a target or MTP forward (the
    model's graphs or the MTP layer's, captured at the same sizes) that every contributing group can run
    as a graph (`graphable`: a decode batch a captured graph holds) and one group has tokens: the size is the smallest of `graph_sizes` (the captured sizes, the same on every
    rank) that holds the largest group's batch, and the gather is `uniform` at that size. `split`: the tokens of
    this rank's first micro-batch under two-batch overlap (0: not split), carried in the eager gather's `splits`.

    Otherwise, for a target forward that every contributing group can run through the piecewise graphs
    (`piecewise`: its extend or decode batch fits their largest bucket), every group replays the piecewise
    chain of the smallest of `piecewise_sizes` (the buckets, the same on every rank) that holds the widest
    group's tokens, with a `uniform` gather at that width."""
    if max(tokens, split) >> _TOKEN_BITS:
        raise ValueError(f"a forward of {tokens} tokens is more than DP attention's agreement can carry")
    offer = (kind << _KIND_SHIFT) | (split << _SPLIT_SHIFT) | (tokens << _TOKEN_SHIFT) | (int(piecewise) << 1)
    every = comm.all_gather_ints(offer | int(graphable), group)
    per_group = group.size // group.dp_size
    firsts = [every[g * per_group] for g in range(group.dp_size)]
    kinds = [v >> _KIND_SHIFT for v in firsts]
    run = min(kinds)
    mine = [k == run for k in kinds]
    mask = (1 << _TOKEN_BITS) - 1
    counts = [(v >> _TOKEN_SHIFT) & mask if m else 0 for v, m in zip(firsts, mine)]
    splits = [(v >> _SPLIT_SHIFT) & mask if m else 0 for v, m in zip(firsts, mine)]
    widest = max(counts)
    graphs = all(v & 1 or not c for v, c in zip(firsts, counts))
    if run in (TARGET, MTP) and graph_sizes and graphs and 0 < widest <= max(graph_sizes):
        bs = min(s for s in graph_sizes if s >= widest)
        return Agreement(run, uniform(group, bs), bs, real=counts)
    pieces = all(v & 2 or not c for v, c in zip(firsts, counts))
    if run == TARGET and piecewise_sizes and pieces and 0 < widest <= max(piecewise_sizes):
        n = min(s for s in piecewise_sizes if s >= widest)
        return Agreement(run, DPGather(group, [n] * group.dp_size), None, n, real=counts)
    return Agreement(run, DPGather(group, counts, splits), None, real=counts)
