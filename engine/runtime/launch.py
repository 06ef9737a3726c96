"""Start this node's rank processes and supervise them: one failure stops them all, with its reason.

`start_ranks(target, nprocs, args)` starts `nprocs` processes (multiprocessing "spawn", the only
start method that is safe with CUDA), each running `target(local_rank, *args)`; `target` must be a
module-level function and `args` picklable. It returns a `RankSupervisor`:

- `wait()` blocks until every rank returned (None) or one failed: a rank that raises sends its
  exception text through a pipe before dying; a rank killed by a signal or exiting non-zero is
  seen through its process sentinel. The supervisor then stops the other ranks (SIGTERM, then
  SIGKILL after `grace` seconds) and returns a `RankFailure` whose `message()` reads
  "rank R (pid P) failed: <first line of its error, or the signal>". When several ranks fail
  together (the others usually fail *because* one died: their peer connections close) the root
  cause is picked: a rank killed by a signal or exiting without an error message first, else the
  earliest error.
- `poll()` is the non-blocking form (for a server loop); `stop()` ends every rank and leaves no
  process behind; it is also registered with atexit.

Ranks die with their parent: each sets PR_SET_PDEATHSIG (SIGKILL, Linux, when started from the
main thread: the kernel ties it to the *thread* that forked) and runs a watchdog thread that exits
the process as soon as os.getppid() changes, so a SIGKILLed server leaves no orphans.

This module does not import torch: supervisors and the ranks' bootstrap stay light.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Optional, Sequence

from engine.distributed.parallel_config import ParallelConfig

PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL_S = 0.5
SETTLE_S = 0.3  # after a first failure, how long to collect the others before picking the root cause


@dataclass(frozen=True)
class RankFailure:
    rank: int
    pid: int
    reason: str  # first line of the error, "killed by SIGKILL", "exited with code 3"
    details: str = ""  # the full traceback when the rank raised
    raised: bool = False  # the rank reported an exception (vs. a signal or a bare exit code)
    at: float = 0.0  # time.time() of the error (ranks that raised) or when the supervisor saw it

    def message(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) failed: {self.reason}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (tests and single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_local_init_addr(config: ParallelConfig) -> ParallelConfig:
    """A single-node config with no --dist-init-addr gets 127.0.0.1 and a free port."""
    if config.dist_init_addr is not None or config.nnodes > 1:
        return config
    return replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")


# ---------------------------------------------------------------------------- in the rank process


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    head = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {head}" if head else type(exc).__name__


def _die_with_parent(parent_pid: int, use_prctl: bool) -> None:
    if use_prctl and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # the watchdog below still works
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_INTERVAL_S)
    os._exit(1)


def _rank_main(target: Callable[..., Any], local_rank: int, args: tuple, conn, parent_pid: int,
               use_prctl: bool) -> None:
    _die_with_parent(parent_pid, use_prctl)
    try:
        target(local_rank, *args)
    except SystemExit:
        raise  # its exit code speaks for itself
    except BaseException as exc:
        try:
            conn.send(("error", time.time(), _first_line(exc), traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        conn.close()


# ---------------------------------------------------------------------------- in the parent


def _exit_reason(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RankSupervisor:
    """Watches the rank processes of this node (see the module docstring)."""

    def __init__(self, procs: Sequence[Any], conns: Sequence[Any], first_rank: int = 0, grace: float = 5.0):
        self.procs, self.conns = list(procs), list(conns)
        self.first_rank, self.grace = first_rank, grace
        self.errors: dict[int, tuple] = {}  # index -> ("error", time, first line, traceback)
        self.done: set[int] = set()  # indices whose process exited with code 0
        self.failures: dict[int, RankFailure] = {}
        self.root: Optional[RankFailure] = None  # the failure that stopped the ranks, once known
        self.stopped = False
        atexit.register(self.stop)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> list[int]:
        """Pids of the ranks still running."""
        return [p.pid for p in self.procs if p.is_alive()]

    def poll(self) -> Optional[RankFailure]:
        """The failure if a rank has failed (the others are then stopped), else None; never blocks long."""
        if self.stopped:
            return self.root
        self._collect(timeout=0)
        return self._settle_and_stop() if self.failures else None

    def wait(self, timeout: Optional[float] = None) -> Optional[RankFailure]:
        """Block until every rank finished (None) or one failed (its RankFailure, the others stopped).

        TimeoutError when `timeout` seconds pass first (the ranks keep running)."""
        if self.stopped:
            return self.root
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._collect(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self.failures:
                return self._settle_and_stop()
            if len(self.done) == len(self.procs):
                self.stop()
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout}s: pids {self.alive()}")

    def stop(self, grace: Optional[float] = None) -> None:
        """SIGTERM every live rank, SIGKILL those left after `grace` seconds, reap them all."""
        grace = self.grace if grace is None else grace
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self.conns:
            c.close()
        if not self.stopped:
            self.stopped = True
            atexit.unregister(self.stop)

    def __enter__(self) -> "RankSupervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- internals -----------------------------------------------------------
    def _pending(self) -> list[int]:
        return [i for i in range(len(self.procs)) if i not in self.done and i not in self.failures]

    def _collect(self, timeout: Optional[float]) -> None:
        """Wait up to `timeout` for any rank event, then record every event that is ready."""
        pending = self._pending()
        if not pending:
            return
        handles = [self.procs[i].sentinel for i in pending] + [self.conns[i] for i in pending
                                                                 if not self.conns[i].closed]
        wait_any(handles, timeout)
        for i in pending:
            p = self.procs[i]
            exited = not p.is_alive()
            if exited:
                p.join()
            self._read_message(i)  # after the exit check, so a message sent just before exiting is seen
            if i in self.errors:
                _, at, line, tb = self.errors[i]
                self.failures[i] = RankFailure(self.first_rank + i, p.pid, line, tb, raised=True, at=at)
            elif exited and p.exitcode == 0:
                self.done.add(i)
            elif exited:
                self.failures[i] = RankFailure(self.first_rank + i, p.pid, _exit_reason(p.exitcode), at=time.time())

    def _read_message(self, i: int) -> None:
        conn = self.conns[i]
        try:
            while not conn.closed and conn.poll():
                msg = conn.recv()
                if msg and msg[0] == "error":
                    self.errors[i] = msg
        except (EOFError, OSError):
            conn.close()

    def _settle_and_stop(self) -> RankFailure:
        end = time.monotonic() + SETTLE_S
        while self._pending() and time.monotonic() < end:
            self._collect(timeout=max(0.0, end - time.monotonic()))
        self.root = min(self.failures.values(), key=lambda f: (f.raised, f.at))
        self.stop()
        return self.root


def start_ranks(target: Callable[..., Any], nprocs: int, args: tuple = (), *, first_rank: int = 0,
                grace: float = 5.0) -> RankSupervisor:
    """Start `nprocs` spawned processes running target(local_rank, *args); `first_rank` only names
    them in failure messages (node_rank * ranks_per_node on multi-node jobs)."""
    ctx = mp.get_context("spawn")
    parent = os.getpid()
    use_prctl = threading.current_thread() is threading.main_thread()
    procs, conns = [], []
    try:
        for local_rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(target, local_rank, args, send, parent, use_prctl),
                            name=f"dsctl-rank-{first_rank + local_rank}")
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
    except BaseException:
        RankSupervisor(procs, conns, first_rank, grace).stop(grace=0.5)
        raise
    return RankSupervisor(procs, conns, first_rank, grace)
