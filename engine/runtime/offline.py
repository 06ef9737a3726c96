"""Offline generation from an ordinary (front-end) process: `open_engine` and `RankedEngine`.

`open_engine(args)` runs the launch checks (launch_checks.py) and returns an `Engine` for --tp 1
and a `RankedEngine` otherwise: both offer `generate()`, `tokenizer`, `config` and `close()`.

`RankedEngine` starts the ranks (`EngineRanks`: the rank loop of rank_loop.py, the same processes
`dsctl serve` runs) and talks to rank 0 with the serving protocol (protocol.py): add requests,
collect their deltas, build the outputs exactly as the one-process Engine does. A rank that
fails ends the call with an `EngineRankError` naming it.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from engine.args import EngineArgs
from engine.checkpoint.resolve import ResolvedModel
from engine.checkpoint.tokenizer import load_tokenizer
from engine.engine import Engine, build_output, per_prompt, prompt_token_lists
from engine.errors import RequestError, UsageError
from engine.runtime.launch_checks import check_launch, launch_args
from engine.runtime.protocol import AddFailed, AddRequest, EngineInfo, ExpertLoadUpdate, ReportExpertLoad, StepOutputs
from engine.runtime.ranks import EngineRankError, EngineRanks
from engine.sampling import SamplingParams
from engine.scheduler.output import CollectedOutput

CLOSE_TIMEOUT_S = 30.0


def open_engine(args: EngineArgs):
    """An Engine (one process) or a RankedEngine (--tp > 1), checked before any weight is read."""
    args = launch_args(args)
    resolved = check_launch(args)
    if args.parallel.config().world_size == 1:
        return Engine(args)
    return RankedEngine(args, resolved)


class RankedEngine:
    """--tp N engine ranks driven from this process (offline generation, tests). `rank_main`: each rank's
    entry point (default `engine_main`; tests pass it a `make_engine`)."""

    def __init__(self, args: EngineArgs, resolved: Optional[ResolvedModel] = None, rank_main=None):
        args = launch_args(args)
        resolved = check_launch(args, resolved)
        if args.parallel.nnodes > 1:
            raise UsageError("offline generation runs on one node; use `dsctl serve` for --nnodes > 1")
        self.args = args
        self.tokenizer = load_tokenizer(resolved.tokenizer_path)
        self.config = resolved.config
        self._ranks = EngineRanks.start_engine(args, rank_main)
        self._ids = itertools.count()
        self.info = self._receive(EngineInfo)
        self.stats = None  # the EngineStats of rank 0's latest step outputs

    def _receive(self, kind):
        while True:
            msg = self._ranks.receive()
            if isinstance(msg, kind):
                return msg

    # ---- generation ----------------------------------------------------------
    def generate(
        self,
        prompts: Union[str, Sequence[str], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
        dp_rank: Optional[int] = None,
    ):
        """Same contract as Engine.generate: outputs in input order. `dp_rank` (DP attention): send every
        request to that DP group instead of letting the controller spread them."""
        token_lists = prompt_token_lists(prompts, input_ids, self.encode)
        params = per_prompt(sampling_params, len(token_lists))
        rids = [f"g{next(self._ids)}" for _ in token_lists]
        for rid, ids, p in zip(rids, token_lists, params):
            self._ranks.send(AddRequest(rid, ids, p.validate(), dp_rank=dp_rank))
        collected = {rid: CollectedOutput() for rid in rids}
        left = set(rids)
        while left:
            msg = self._ranks.receive()
            if isinstance(msg, AddFailed) and msg.rid in collected:
                raise (RequestError if msg.user_error else EngineRankError)(msg.message)
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                for out in msg.outputs:
                    if out.rid in collected:
                        collected[out.rid].add(out)
                        if out.finished:
                            left.discard(out.rid)
        if self.stats is not None and self.stats.running:  # finished, not released yet (or others still run):
            self.stats = self._receive(StepOutputs).stats  # the ranks' next step releases them and reports that
        return [build_output(ids, p, collected[rid], self._decode) for rid, ids, p in zip(rids, token_lists, params)]

    def expert_load(self):
        """The ranks' summed routing counts since ready (engine/model/expert_load.py's ExpertLoadReport; None
        without --record-expert-load)."""
        self._ranks.send(ReportExpertLoad())
        return self._receive(ExpertLoadUpdate).report

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.args.model.model} has no tokenizer files here; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special) if self.tokenizer else ""

    def spec_accept_hist(self) -> tuple[int, ...]:
        """As Engine.spec_accept_hist, as of the latest step outputs (those of a finished generate call
        include its last step); every DP group's steps added up."""
        return tuple(self.stats.spec_accept_hist) if self.stats is not None else ()

    # ---- lifecycle -----------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, rank order."""
        return self._ranks.pids

    def alive(self) -> list[int]:
        """Pids of the ranks still running."""
        return self._ranks.alive()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every rank (cleanly when they answer, else by signal); idempotent."""
        self._ranks.shutdown(timeout)

    def __enter__(self) -> "RankedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
