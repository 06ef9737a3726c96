"""Rank bodies for the supervisor tests. No torch import here: spawned ranks start in a fraction of a second.

Also runnable as a script (`python -m tests.distributed.rank_targets orphan [thread]`): a parent that
starts two sleeping ranks, prints their pids and waits, for the parent-death test.
"""

import os
import signal
import sys
import threading
import time

from engine.runtime.launch import start_ranks


def sleep_long(local_rank: int) -> None:
    time.sleep(120)


def finish(local_rank: int, marker_dir: str) -> None:
    with open(os.path.join(marker_dir, f"rank{local_rank}"), "w") as f:
        f.write(str(os.getpid()))


def raise_on(local_rank: int, bad: int, delay: float) -> None:
    if local_rank == bad:
        time.sleep(delay)
        raise ValueError(f"boom on rank {local_rank}\nsecond line of the message")
    time.sleep(120)


def kill_self_on(local_rank: int, bad: int) -> None:
    if local_rank == bad:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def exit_on(local_rank: int, bad: int, code: int) -> None:
    if local_rank == bad:
        sys.exit(code)
    time.sleep(120)


def peers_fail_after(local_rank: int, bad: int) -> None:
    """Rank `bad` dies by a signal; the others notice 0.3 s later and raise (like a broken collective)."""
    if local_rank == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    raise ConnectionError("peer closed the connection")


def ignore_sigterm(local_rank: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)


def echo(local_rank: int, kill_rank: int, inbox, outbox) -> None:
    """An `EngineRanks` target: rank 0 echoes every str it receives and returns on anything else; rank
    `kill_rank` (-1: none) dies by SIGKILL; the other ranks return at once."""
    if local_rank == kill_rank:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if local_rank != 0:
        return
    while isinstance(msg := inbox.recv(), str):
        outbox.send(msg)


def _orphan_parent(from_thread: bool) -> None:
    box = {}

    def start():
        box["sup"] = start_ranks(sleep_long, 2)

    if from_thread:  # PR_SET_PDEATHSIG is skipped off the main thread: only the watchdog is left
        t = threading.Thread(target=start)
        t.start()
        t.join()
    else:
        start()
    print(" ".join(map(str, box["sup"].pids)), flush=True)
    time.sleep(120)


if __name__ == "__main__":
    _orphan_parent(from_thread=sys.argv[1:] == ["orphan", "thread"])
