"""The rank supervisor (engine/runtime/launch.py) and `EngineRanks` (ranks.py) with real spawned processes
(no torch in the ranks: quick).

A rank that raises, is killed or exits non-zero is reported by rank, pid and reason, and the other
ranks are gone within a few seconds; stop() leaves no process behind, even one that ignores
SIGTERM; ranks die when their parent is SIGKILLed (PR_SET_PDEATHSIG and the getppid watchdog).
`EngineRanks` carries messages to and from rank 0, and `receive` names the rank that failed.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.distributed.parallel_config import ParallelConfig
from engine.runtime.launch import free_port, start_ranks, with_local_init_addr
from engine.runtime.ranks import EngineRankError, EngineRanks
from tests.distributed import rank_targets as rt

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """No such process, or only a zombie left (its parent, e.g. init, has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def wait_gone(pids, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(gone(p) for p in pids)


def test_all_ranks_finish(tmp_path):
    with start_ranks(rt.finish, 3, (str(tmp_path),)) as sup:
        assert sup.wait(timeout=60) is None
        pids = sup.pids
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1", "rank2"]
    assert {int((tmp_path / f"rank{i}").read_text()) for i in range(3)} == set(pids)
    assert all(gone(p) for p in pids)


def test_raising_rank_is_reported_and_the_others_stopped():
    sup = start_ranks(rt.raise_on, 3, (1, 0.5), first_rank=4)
    try:
        failure = sup.wait(timeout=60)
        seen = time.monotonic()
        assert failure is not None
        assert failure.rank == 5 and failure.pid == sup.pids[1]
        assert failure.message() == f"rank 5 (pid {sup.pids[1]}) failed: ValueError: boom on rank 1"
        assert "second line" in failure.details and "Traceback" in failure.details
        assert wait_gone(sup.pids, 5.0) and time.monotonic() - seen < 5.0
        assert sup.poll() is failure and sup.wait() is failure  # the others' SIGTERM is not a new failure
    finally:
        sup.stop()


@pytest.mark.parametrize("target, args, reason", [
    (rt.kill_self_on, (0,), "killed by SIGKILL"),
    (rt.exit_on, (1, 3), "exited with code 3"),
    (rt.peers_fail_after, (1,), "killed by SIGKILL"),  # the root cause, not the peers' later errors
])
def test_killed_or_exiting_rank(target, args, reason):
    sup = start_ranks(target, 3, args)
    try:
        failure = sup.wait(timeout=60)
        bad = args[0]
        assert failure.message() == f"rank {bad} (pid {sup.pids[bad]}) failed: {reason}"
        assert wait_gone(sup.pids, 5.0)
    finally:
        sup.stop()


def test_poll_and_timeout():
    sup = start_ranks(rt.sleep_long, 2)
    try:
        assert sup.poll() is None
        with pytest.raises(TimeoutError):
            sup.wait(timeout=0.2)
        assert len(sup.alive()) == 2
    finally:
        sup.stop()
    assert all(gone(p) for p in sup.pids)
    assert sup.poll() is None  # stopped on purpose: no failure


def test_stop_kills_a_rank_that_ignores_sigterm():
    sup = start_ranks(rt.ignore_sigterm, 2)
    time.sleep(1.0)  # let them install the handler
    t = time.monotonic()
    sup.stop(grace=0.5)
    assert time.monotonic() - t < 4.0
    assert all(gone(p) for p in sup.pids)
    assert [p.exitcode for p in sup.procs] == [-signal.SIGKILL] * 2


@pytest.mark.parametrize("mode, sig", [("main", signal.SIGKILL), ("thread", signal.SIGKILL), ("main", signal.SIGTERM)])
def test_ranks_die_with_their_parent(mode, sig):
    """A parent started from its main thread relies on PR_SET_PDEATHSIG, one started from another
    thread on the watchdog; either way a SIGKILLed or SIGTERMed parent leaves no rank behind."""
    args = [sys.executable, "-m", "tests.distributed.rank_targets", "orphan"] + (["thread"] if mode == "thread" else [])
    parent = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(10)
        assert wait_gone(pids, 5.0), "ranks outlived their parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_free_port_and_local_init_addr():
    port = free_port()
    assert 0 < port < 65536
    pc = with_local_init_addr(ParallelConfig(tp_size=2))
    host, p = pc.host_port()
    assert host == "127.0.0.1" and 0 < p < 65536
    multi = ParallelConfig(tp_size=4, nnodes=2, dist_init_addr="10.1.1.1:7000")
    assert with_local_init_addr(multi) is multi


def test_engine_ranks_carry_messages_to_rank_0_and_back():
    ranks = EngineRanks.start(rt.echo, ParallelConfig(tp_size=2), -1)
    try:
        ranks.send("hello")
        ranks.send("again")
        assert [ranks.receive(), ranks.receive()] == ["hello", "again"]
        ranks.send(None)  # rank 0 returns: its pipe closes
        with pytest.raises(EngineRankError, match="^the engine's rank 0 exited$"):
            ranks.receive()
    finally:
        ranks.shutdown(timeout=5)
    assert ranks.stopped and wait_gone(ranks.pids, 5)


def test_engine_ranks_receive_names_the_rank_that_failed():
    ranks = EngineRanks.start(rt.echo, ParallelConfig(tp_size=3), 2)
    start = time.monotonic()
    with pytest.raises(EngineRankError, match=r"^engine rank 2 \(pid \d+\) failed: killed by SIGKILL$"):
        ranks.receive()
    assert time.monotonic() - start < 10
    assert wait_gone(ranks.pids, 5) and ranks.alive() == []
    ranks.shutdown(timeout=5)  # idempotent after a failure
