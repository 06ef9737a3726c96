"""One rank's side of DP attention's per-forward agreement (engine/distributed/dp_attention.py `agree`).

Before each of its own forwards the rank agrees with every other rank on what runs next; while another
group's forward of another kind runs first, this rank joins it with no tokens of its own (an idle
forward), then offers its own again. After its step it joins the other groups' remaining forwards until
every rank is done (`finish_iteration`), so each iteration's collectives pair up.

This layer sits below the model: the runner hands in how to set a forward's gather (`set_gather`) and,
per forward kind, how to run that forward idle (`IdleForward`: eagerly, its CUDA graph on padding rows, or the
piecewise graphs of a token bucket on padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from engine.distributed.dp_attention import DONE, Agreement, DPGather, agree, uniform
from engine.distributed.groups import TPGroup


@dataclass
class IdleForward:
    """How this rank joins, with no tokens of its own, a forward of one kind that other DP groups run."""

    eager: Callable[[], None]  # every layer's gather / MLP / scatter on no tokens (attention is skipped)
    replay_padding: Callable[[int], None]  # that kind's CUDA graph of the given size, on padding rows only
    replay_piecewise: Optional[Callable[[int], None]] = None  # the piecewise graphs of a bucket, padding rows only


class DPSync:
    def __init__(self, group: TPGroup, set_gather: Callable[[DPGather], None]):
        """group: the model's (world) group, with dp_size > 1; set_gather: makes a gather the next forward's."""
        self.group = group
        self.set_gather = set_gather
        self.graph_sizes: Sequence[int] = ()  # the captured CUDA-graph sizes (the same on every rank)
        self.piecewise_sizes: Sequence[int] = ()  # the piecewise graphs' token buckets (the same on every rank)
        self.real: list[int] = []  # each group's own tokens in the forward agreed last (what padding adds to)
        self.idle: dict[int, IdleForward] = {}  # per forward kind (dp_attention.MTP / TARGET)

    def add_idle(self, kind: int, idle: IdleForward) -> None:
        self.idle[kind] = idle

    def before_forward(self, kind: int, tokens: int, graphable: bool = False, split: int = 0,
                       piecewise: bool = False) -> Agreement:
        """Before this rank's own forward of `kind` (`tokens` tokens; `graphable`: a captured CUDA graph holds
        it; `piecewise`: the piecewise graphs do): run the idle forwards of other kinds that other groups run
        first, until every group agrees on this kind; sets this forward's gather and returns the agreement:
        the padded size whose CUDA graph every group replays, or the piecewise bucket, or neither (eager).
        `split`: the tokens of its first micro-batch under two-batch overlap (0: not split)."""
        while True:
            agreed = self._agree(kind, tokens, graphable, split, piecewise)
            if agreed.kind == kind:
                return agreed
            self._join(agreed)

    @torch.inference_mode()
    def finish_iteration(self) -> None:
        """After this rank's step: join the forwards other groups still run (idle, with no tokens of its own)
        until every rank has none left, so that each iteration's collectives pair up."""
        while (agreed := self._agree(DONE, 0, True, piecewise=True)).kind != DONE:
            self._join(agreed)

    def prepare_graph(self, bs: int) -> None:
        """Before a CUDA graph's capture or replay at padded size bs: the gather every group records at that
        same size (`uniform`), so that its shapes are fixed."""
        self.set_gather(uniform(self.group, bs))

    def _agree(self, kind: int, tokens: int, graphable: bool, split: int = 0, piecewise: bool = False) -> Agreement:
        agreed = agree(kind, tokens, self.group, self.graph_sizes, graphable, split, self.piecewise_sizes, piecewise)
        self.set_gather(agreed.gather)
        self.real = agreed.real
        return agreed

    @torch.inference_mode()
    def _join(self, agreed: Agreement) -> None:
        """The agreed forward with no tokens of this group's: its CUDA graph or piecewise graphs on padding rows,
        or eagerly."""
        if agreed.graph_bs is not None:
            self.idle[agreed.kind].replay_padding(agreed.graph_bs)
        elif agreed.piecewise_bs is not None:
            self.idle[agreed.kind].replay_piecewise(agreed.piecewise_bs)
        elif agreed.gather.total > 0:
            self.idle[agreed.kind].eager()
