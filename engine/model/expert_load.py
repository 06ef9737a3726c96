"""Routing counts (`--record-expert-load`): tokens routed to each expert slot of each MoE layer, on the device.

Each MoE layer adds its routing of the step's real tokens to one row of a [layers, slots] int64 tensor (a
masked scatter-add, no host synchronisation, so it runs inside CUDA graphs). Which rows a rank counts: its
own tokens only, so that the ranks' counts sum to the job's without double counting: under plain TP (every
rank routes every token) rank 0; under DP attention each DP group's first rank, its group's block of the
gathered rows; under the all-to-all exchange every rank, its share. Padded forwards (CUDA graphs, piecewise
graphs, the exchange's fixed-size mode: `ctx.static_shapes`) count only the rows before `real_rows`, which
`begin_forward` sets to the forward's real token count before the graph replays.

`totals` sums every rank's counts (a collective: every rank calls it at the same point of its loop,
engine/runtime/rank_loop.py) and `report` turns them into what the server shows: per layer, tokens per
logical expert and per EP rank (engine/distributed/expert_placement.py maps slots to both).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.distributed import comm
from engine.distributed.expert_placement import imbalance, rank_loads
from engine.distributed.groups import TPGroup


@dataclass
class LayerLoad:
    logical: list[int]  # tokens routed to each logical expert (all its copies)
    ranks: list[int]  # tokens routed to each EP rank's slots (one entry without EP)


@dataclass
class ExpertLoadReport:
    """Cumulative routing counts since the engine became ready (sent by rank 0 to the server)."""

    ep_size: int
    num_experts: int
    layers: dict[int, LayerLoad]

    def to_json(self) -> dict:
        return {"ep_size": self.ep_size, "num_experts": self.num_experts,
                "layers": {str(k): {"logical": v.logical, "ranks": v.ranks} for k, v in sorted(self.layers.items())}}

    def rank_totals(self) -> list[int]:
        """Tokens routed to each EP rank's experts, over all layers."""
        return [sum(col) for col in zip(*(v.ranks for v in self.layers.values()))] if self.layers else []

    def imbalance(self) -> float:
        """Mean over layers of the busiest rank's load over the mean rank's (1.0: balanced; 0 before any)."""
        ratios = [imbalance(v.ranks) for v in self.layers.values() if sum(v.ranks)]
        return sum(ratios) / len(ratios) if ratios else 0.0


class ExpertLoad:
    """The device counts of one rank; `slots` maps each MoE layer (checkpoint index) to its slot -> logical
    expert list (the plain layout's: 0 .. E - 1)."""

    def __init__(self, slots: dict[int, Sequence[int]], num_experts: int, ep_size: int, device: torch.device):
        self.slots = {k: tuple(v) for k, v in slots.items()}
        self.num_experts, self.ep_size = num_experts, ep_size
        self.row = {layer: i for i, layer in enumerate(sorted(self.slots))}
        width = max((len(v) for v in self.slots.values()), default=1)
        self.counts = torch.zeros(len(self.row), width, dtype=torch.int64, device=device)
        self.real_rows = torch.zeros((), dtype=torch.int64, device=device)

    def view(self) -> ExpertLoad:
        """These counts with a real-row count of its own (a two-batch-overlap micro-batch's)."""
        other = copy.copy(self)
        other.real_rows = torch.zeros_like(self.real_rows)
        return other

    def begin_forward(self, real_rows: int) -> None:
        """Before a forward (outside any graph capture): how many of its rows are real tokens."""
        self.real_rows.fill_(real_rows)

    def record(self, layer: int, ids: torch.Tensor, padded: bool, first_row: int = 0) -> None:
        """Count routed slot ids [R, k] of this rank's own rows (rows past `real_rows`, counted from `first_row`,
        are padding when `padded`; ids outside the layer's slots, e.g. -1, are no expert)."""
        row = self.counts[self.row[layer]]
        ok = (ids >= 0) & (ids < len(self.slots[layer]))
        if padded:
            n = torch.arange(ids.shape[0], device=ids.device) + first_row
            ok = ok & (n < self.real_rows).unsqueeze(1)
        row.index_add_(0, torch.where(ok, ids, torch.zeros_like(ids)).flatten().long(), ok.flatten().long())

    def reset(self) -> None:
        self.counts.zero_()

    def totals(self, group: Optional[TPGroup]) -> torch.Tensor:
        """Every rank's counts summed ([layers, slots] on the host; a collective over `group`'s ranks)."""
        total = self.counts.clone()
        if group is not None and group.size > 1:
            comm.all_reduce(total, group)
        return total.cpu()

    def report(self, totals: torch.Tensor) -> ExpertLoadReport:
        layers = {}
        for layer, i in self.row.items():
            slots = self.slots[layer]
            per_slot = totals[i, : len(slots)].tolist()
            logical = [0] * self.num_experts
            for e, n in zip(slots, per_slot):
                logical[e] += n
            layers[layer] = LayerLoad(logical, [int(x) for x in rank_loads(slots, per_slot, self.ep_size)])
        return ExpertLoadReport(self.ep_size, self.num_experts, layers)
