"""`dsctl bench one-batch` over several ranks (--tp N, with DP attention or EP): one process per GPU.

The parent starts this node's ranks (engine.distributed.launch.start_ranks, the processes `dsctl
serve` uses) and shows their progress; every rank joins the torch.distributed world, builds its
`ModelRunner` shard and times the same static batches in lockstep (dsctl/bench_one_batch.py
`time_shapes`), so every collective pairs up. World rank 0 sends its figures back through a pipe.

With DP attention the batch is spread over the DP groups (`batch_share`: bs // dp requests each, the
first bs % dp groups one more), as a DP-attention server spreads requests; a group with none joins
the others' forwards idle. Rank 0 always holds a share, and each timed step ends when every group's
forward has (the forwards are collective), so its times are the layout's step times.

`next_message` / `wait_exit` (rank 0's next message while the supervisor watches every rank; the ranks'
exit) serve any benchmark that runs its own rank target, e.g. benchmarks/bench_collectives.py.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Optional

from engine.args import EngineArgs
from engine.errors import DsctlError, UsageError

POLL_S = 0.2
EXIT_S = 60.0  # how long the ranks get to leave the world once rank 0 sent its figures


class BenchRankError(DsctlError):
    """A benchmark rank failed (the message names the rank and its error)."""


def rank_main(local_rank: int, args: EngineArgs, shapes: list, repeats: int, profile: Optional[Path],
              outbox) -> None:
    """One rank (a `start_ranks` target): join the world, build this rank's runner, time every shape; world
    rank 0 sends ("progress", text) per run and finally ("done", results, meta)."""
    from dsctl.bench_one_batch import meta_of, time_shapes
    from engine.distributed.groups import init_parallel
    from engine.runner import ModelRunner, pick_device

    pc = args.parallel.config()
    state = init_parallel(pc, local_rank, pick_device(args.model.device).type)
    first = state.world_rank == 0
    if not first:
        outbox.close()
    try:
        runner = ModelRunner(args, parallel=state)
        report = (lambda text: outbox.send(("progress", text))) if first else (lambda text: None)
        results = time_shapes(runner, shapes, repeats, args.model.seed, report, profile)
        if first:
            outbox.send(("done", results, meta_of(args, runner)))
        runner.close()
    finally:
        state.destroy()


def bench_ranked(args: EngineArgs, shapes: list, repeats: int, profile: Optional[Path], on_progress) -> tuple:
    """Run `rank_main` on this node's ranks; (results, meta) from world rank 0. `on_progress(text)` is called
    once per warm-up or timed run."""
    from engine.distributed.launch import start_ranks, with_local_init_addr

    pc = args.parallel.config()
    if pc.nnodes > 1:
        raise UsageError("bench one-batch runs on one node; benchmark several nodes with `dsctl serve` and "
                         "`dsctl bench serving`")
    pc = with_local_init_addr(pc)
    args = args.replace(dist_init_addr=pc.dist_init_addr)
    recv, send = mp.get_context("spawn").Pipe(duplex=False)
    with start_ranks(rank_main, pc.ranks_per_node, (args, shapes, repeats, profile, send)) as ranks:
        send.close()
        while (msg := next_message(ranks, recv, "bench one-batch"))[0] != "done":
            on_progress(msg[1])
        wait_exit(ranks, "bench one-batch")
    return msg[1], msg[2]


def next_message(ranks, recv, what: str):
    """The next message world rank 0 sends through `recv` while `ranks` (a RankSupervisor) run; BenchRankError
    naming `what` when a rank failed or rank 0 closed its pipe without sending."""
    while True:
        failure = ranks.poll()
        if failure is not None:
            raise BenchRankError(f"{what}: {failure.message()}")
        try:
            if recv.poll(POLL_S):
                return recv.recv()
        except (EOFError, OSError):
            failure = _wait(ranks)
            reason = failure.message() if failure is not None else "rank 0 closed its pipe without results"
            raise BenchRankError(f"{what}: {reason}") from None


def wait_exit(ranks, what: str) -> None:
    """After the last message: let the ranks leave the world (EXIT_S), BenchRankError if one failed. Ranks still
    there after that are stopped by the supervisor's exit: the figures are already in."""
    failure = _wait(ranks)
    if failure is not None:
        raise BenchRankError(f"{what}: {failure.message()}")


def _wait(ranks):
    try:
        return ranks.wait(timeout=EXIT_S)
    except TimeoutError:
        return None
