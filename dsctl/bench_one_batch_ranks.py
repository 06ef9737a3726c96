"""`dsctl bench one-batch` over several ranks (--tp N, with DP attention or EP): one process per GPU.

The parent starts this node's ranks the way every launcher does (`EngineRanks.start_engine`, with this
module's `rank_main` as their entry point) and shows their progress; every rank joins the
torch.distributed world, builds its `ModelRunner` shard and times the same static batches in lockstep
(dsctl/bench_one_batch_timing.py `time_shapes`), so every collective pairs up. World rank 0 sends its
figures back through its pipe (on CUDA with each step's bytes floor, at the copy bandwidth it measured
before building its runner); a rank that fails ends the run with a `BenchRankError` naming it.

With DP attention the batch is spread over the DP groups (`batch_share`: bs // dp requests each, the
first bs % dp groups one more), as a DP-attention server spreads requests; a group with none joins
the others' forwards idle. Rank 0 always holds a share, and each timed step ends when every group's
forward has (the forwards are collective), so its times are the layout's step times.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dsctl.bench_one_batch_timing import add_floors, measure_bandwidth, meta_of, time_shapes
from engine.args import EngineArgs
from engine.distributed.comm import barrier
from engine.distributed.groups import init_parallel
from engine.errors import UsageError
from engine.runner.device import pick_device
from engine.runner.model_runner import ModelRunner
from engine.runtime.ranks import EngineRankError, EngineRanks

EXIT_S = 60.0  # how long the ranks get to leave the world once rank 0 sent its figures


class BenchRankError(EngineRankError):
    """A benchmark rank failed (the message names the rank and its error)."""


@dataclass(frozen=True)
class BenchJob:
    """What every rank times: (batch size, input length, output length) shapes, timed runs each, trace path."""

    shapes: list
    repeats: int
    profile: Optional[Path]


def rank_main(local_rank: int, args: EngineArgs, inbox, outbox, job: BenchJob) -> None:
    """One rank (an `EngineRanks` target): join the world, build this rank's runner, time every shape; world
    rank 0 sends ("progress", text) per run and finally ("done", results, meta)."""
    pc = args.parallel.config()
    state = init_parallel(pc, local_rank, pick_device(args.model.device).type)
    first = state.world_rank == 0
    if not first:
        inbox.close()
        outbox.close()
    try:
        bandwidth = measure_bandwidth(state.device) if first else None  # (rank 0's GPU stands for all)
        runner = ModelRunner(args, parallel=state)
        report = (lambda text: outbox.send(("progress", text))) if first else (lambda text: None)
        results = time_shapes(runner, job.shapes, job.repeats, args.model.seed, report, job.profile)
        if first:
            outbox.send(("done", add_floors(runner, results, bandwidth), meta_of(args, runner, bandwidth)))
        runner.close()
        # every rank done with the world before any tears it down: a rank that destroyed its groups while
        # another still used them was seen to abort once (SIGABRT, "terminate called", CPU CI under load)
        barrier(state.tp)
    finally:
        state.destroy()


def bench_ranked(args: EngineArgs, shapes: list, repeats: int, profile: Optional[Path], on_progress) -> tuple:
    """Run `rank_main` on this node's ranks; (results, meta) from world rank 0. `on_progress(text)` is called
    once per warm-up or timed run."""
    if args.parallel.nnodes > 1:
        raise UsageError("bench one-batch runs on one node; benchmark several nodes with `dsctl serve` and "
                         "`dsctl bench serving`")
    ranks = EngineRanks.start_engine(args, functools.partial(rank_main, job=BenchJob(shapes, repeats, profile)))
    try:
        while (msg := ranks.receive())[0] != "done":
            on_progress(msg[1])
        ranks.finish(EXIT_S)
    except EngineRankError as exc:
        raise BenchRankError(f"bench one-batch: {exc}") from None
    finally:
        ranks.stop()
    return msg[1], msg[2]
