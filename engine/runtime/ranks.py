"""EngineRanks: this node's rank processes and the two pipes to world rank 0, with their failure handling.

Every launcher uses it: the HTTP server's `EngineClient`, the offline `RankedEngine`, the nodes > 0 of a
multi-node job, and the benchmarks that run their own rank target. `start` spawns the ranks
(`launch.start_ranks`, which supervises them); `send` writes to rank 0 (thread-safe); `receive` blocks for
rank 0's next message and raises one `EngineRankError` naming the rank that failed (`failure_reason`);
`shutdown(timeout)` sends `Shutdown`, waits, and stops what is left.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from typing import Any, Callable, Optional

from engine.args import EngineArgs
from engine.distributed.parallel_config import ParallelConfig
from engine.errors import DsctlError
from engine.runtime.launch import RankFailure, start_ranks, with_local_init_addr
from engine.runtime.protocol import EngineFailed, Shutdown

log = logging.getLogger("dsctl.engine")

POLL_S = 0.2  # how often receive() looks at the supervisor while rank 0 is silent
ROOT_CAUSE_S = 10.0  # after rank 0 is gone, how long the others get to exit before they are stopped
STOP_GRACE_S = 2.0  # SIGTERM to SIGKILL when stopping ranks that outlived a shutdown or rank 0


class EngineRankError(DsctlError):
    """An engine rank failed (its message names the rank and its error)."""


def failure_reason(root: Optional[RankFailure], rank0_report: Optional[str]) -> str:
    """What to tell the user when the ranks stopped: the supervisor's root cause (the rank that failed first)
    unless it is rank 0 itself and rank 0 sent its own report."""
    if root is not None and not (root.rank == 0 and rank0_report):
        return f"engine {root.message()}"
    return rank0_report or "the engine's rank 0 exited"


def _engine_main(*args) -> None:
    """rank_loop.engine_main, imported in the rank: the serving process that spawns the ranks builds no model
    and starts seconds sooner without the whole engine's imports (model, torch.compile, Triton)."""
    from engine.runtime.rank_loop import engine_main  # lazy: the whole engine, imported in the rank only

    engine_main(*args)


class EngineRanks:
    """This node's ranks, each running target(local_rank, *target_args, inbox, outbox); world rank 0 reads
    `inbox` and writes `outbox`, the others close theirs."""

    def __init__(self, supervisor, to_rank0, from_rank0):
        self.supervisor = supervisor  # engine.runtime.launch.RankSupervisor
        self._to_rank0, self._from_rank0 = to_rank0, from_rank0
        self._sending = threading.Lock()  # one writer at a time on the pipe to rank 0
        self._watching = threading.Lock()  # one thread at a time waits on the supervisor

    @classmethod
    def start(cls, target: Callable[..., Any], config: ParallelConfig, *target_args) -> "EngineRanks":
        """Spawn this node's ranks of `config` (its dist_init_addr already set); see the class docstring."""
        ctx = mp.get_context("spawn")
        inbox, to_rank0 = ctx.Pipe(duplex=False)
        from_rank0, outbox = ctx.Pipe(duplex=False)
        supervisor = start_ranks(target, config.ranks_per_node, (*target_args, inbox, outbox),
                                 first_rank=config.global_rank(0))
        inbox.close()
        outbox.close()
        return cls(supervisor, to_rank0, from_rank0)

    @classmethod
    def start_engine(cls, args: EngineArgs, rank_main: Optional[Callable[..., Any]] = None) -> "EngineRanks":
        """This node's engine ranks (`rank_main`, default `engine_main`); one node alone gets a local rendezvous."""
        config = with_local_init_addr(args.parallel.config())
        return cls.start(rank_main or _engine_main, config, args.replace(dist_init_addr=config.dist_init_addr))

    # ---- state -----------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, local rank order."""
        return list(self.supervisor.pids)

    def alive(self) -> list[int]:
        """Pids of the ranks still running."""
        return self.supervisor.alive()

    @property
    def stopped(self) -> bool:
        return self.supervisor.stopped

    # ---- messages --------------------------------------------------------------
    def send(self, msg) -> None:
        """Write one message to rank 0 (OSError / ValueError when its pipe is gone)."""
        with self._sending:
            self._to_rank0.send(msg)

    def receive(self):
        """Rank 0's next message; EngineRankError when a rank failed or rank 0 is gone (the others then stopped)."""
        while True:
            failure = self._poll()
            if failure is not None:
                raise EngineRankError(f"engine {failure.message()}")
            try:
                if not self._from_rank0.poll(POLL_S):
                    continue
                msg = self._from_rank0.recv()
            except (EOFError, OSError):
                msg = None
            except Exception as exc:  # noqa: BLE001 - a torn message from a dying process
                msg = EngineFailed(f"unreadable message from the engine process: {exc}")
            if msg is None or isinstance(msg, EngineFailed):
                raise EngineRankError(self._reason_stopped(msg.message if msg is not None else None))
            return msg

    def _poll(self) -> Optional[RankFailure]:
        if not self._watching.acquire(blocking=False):
            return None  # shutdown() is waiting on the supervisor: it sees the failures
        try:
            return self.supervisor.poll()
        finally:
            self._watching.release()

    def _reason_stopped(self, rank0_report: Optional[str]) -> str:
        """Rank 0 is gone or failing: let the supervisor name the rank that failed first (the root cause when
        another rank's death broke rank 0's collectives), else use rank 0's own report."""
        with self._watching:
            try:
                root = self.supervisor.wait(timeout=ROOT_CAUSE_S)
            except TimeoutError:  # rank 0 failed but the others still run: stop them
                self.supervisor.stop(grace=STOP_GRACE_S)
                root = self.supervisor.root
        return failure_reason(root, rank0_report)

    # ---- lifecycle -------------------------------------------------------------
    def wait(self, timeout: Optional[float] = None) -> Optional[RankFailure]:
        """Block until every rank exited (None) or one failed (its RankFailure, the others stopped);
        TimeoutError after `timeout` s."""
        with self._watching:
            return self.supervisor.wait(timeout=timeout)

    def finish(self, timeout: float) -> None:
        """After rank 0's last message: the ranks get `timeout` s to exit, then any left are stopped;
        EngineRankError when one failed."""
        try:
            failure = self.wait(timeout)
        except TimeoutError:
            failure = None
        self.stop()
        if failure is not None:
            raise EngineRankError(f"engine {failure.message()}")

    def shutdown(self, timeout: float) -> None:
        """Send Shutdown (rank 0 aborts what runs and every rank exits), wait up to `timeout` s, then stop
        the ranks still there; idempotent."""
        if self.stopped:
            return
        try:
            self.send(Shutdown())
            self.wait(timeout)
        except (OSError, ValueError):
            pass  # rank 0's pipe is gone
        except TimeoutError:
            log.warning("engine ranks did not exit within %.0fs of the shutdown request; stopping them", timeout)
        self.stop(grace=STOP_GRACE_S)

    def stop(self, grace: Optional[float] = None) -> None:
        """End every rank now (SIGTERM, SIGKILL after `grace` s; default: the supervisor's) and close the pipes."""
        self.supervisor.stop(grace=grace)
        self._to_rank0.close()
        self._from_rank0.close()
