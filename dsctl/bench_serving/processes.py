"""The benchmark's load from one client process or several, so that the client keeps up with the server.

One asyncio loop parsing HTTP in Python saturates a core at a few thousand streamed chunks per
second; chunks then wait in socket buffers and the inter-token latencies measure the client. With N
processes ("spawn": fresh interpreters that import neither torch nor the parent's state), the
concurrency cap is split so that the shares add up to it exactly, and the requests are dealt
round-robin over the concurrency slots (each process gets requests in proportion to its cap), each
with its arrival offset. The total in flight never exceeds the cap; near the end it can dip below
it, where one process runs out of requests before another.

Every process starts its clock at one instant, chosen by the parent once all of them are ready: a
time.perf_counter() value, which on Linux reads CLOCK_MONOTONIC, one clock for the whole machine,
so the instant is the same in every process. Results come back pickled and are put back in request
order; the duration runs from that instant to the last completion in any process. With one process
the load runs here, without spawning. Outputs the server sent no usage for are counted with the
tokenizer afterwards, in this process. (A script calling run_load needs the usual
`if __name__ == "__main__":` guard of "spawn"; the dsctl entry points have it.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import os
import time
from typing import Optional

from dsctl.bench_serving.client import Api, RequestResult, count_tokens
from dsctl.bench_serving.datasets import BenchRequest
from dsctl.bench_serving.runner import Load, arrival_offsets, run_share
from dsctl.bench_serving.tokens import TokenCounter
from engine.errors import DsctlError

IN_FLIGHT_PER_PROCESS = 64  # requests in flight per client process, for the automatic count
START_MARGIN_S = 0.05  # from the last process ready to the common start


class ClientProcessFailed(DsctlError):
    """A client process died or raised outside a request."""

    exit_code = 1


def client_processes(max_concurrency: Optional[int], n_requests: int, cpus: int) -> int:
    """The automatic number of client processes: one per 64 requests in flight (the concurrency cap,
    else every request), at most half of the CPUs, at most one per request, at least one."""
    in_flight = max_concurrency or n_requests
    return max(1, min(math.ceil(in_flight / IN_FLIGHT_PER_PROCESS), cpus // 2, n_requests))


def usable_cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_processes(asked: int, max_concurrency: Optional[int], n_requests: int) -> int:
    """--client-processes (0: automatic), never more than the requests or the concurrency cap."""
    n = asked or client_processes(max_concurrency, n_requests, usable_cpus())
    return max(1, min(n, n_requests, max_concurrency or n_requests))


def split_concurrency(total: Optional[int], n: int) -> list[Optional[int]]:
    """Each process's concurrency cap, adding up to total (256 over 3: 86, 85, 85); None: no cap."""
    if total is None:
        return [None] * n
    return [total // n + (k < total % n) for k in range(n)]


def deal(n_requests: int, caps: list[Optional[int]]) -> list[list[int]]:
    """Which requests each process sends: round-robin over the concurrency slots, so that each gets a
    share in proportion to its cap (caps 3, 2: requests 0, 2, 4, 5, 7, 9, ... and 1, 3, 6, 8, ...);
    without a cap, request i goes to process i mod n."""
    n, slots = len(caps), sum(caps) if caps[0] is not None else len(caps)
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in range(n_requests):
        shares[i % slots % n].append(i)
    return shares


def run_load(api: Api, requests: list[BenchRequest], load: Load, seed: int,
             tok: Optional[TokenCounter] = None, cpu: Optional[list[float]] = None) -> tuple[list[RequestResult], float]:
    """Results in request order, and the wall time from the common start to the last completion.

    cpu: if given, gets the CPU seconds each client process's event loop used over the run.
    """
    offsets = arrival_offsets(len(requests), load.request_rate, seed)
    n = min(load.client_processes, len(requests))
    if n <= 1:
        results, duration, cpu_s = asyncio.run(run_share(api, requests, offsets, load))
        cpu_each = [cpu_s]
    else:
        results, duration, cpu_each = _in_processes(api, requests, offsets, load, n)
    if cpu is not None:
        cpu.extend(cpu_each)
    count_tokens(results, tok)
    return results, duration


def _in_processes(api: Api, requests: list[BenchRequest], offsets: list[float], load: Load,
                  n: int) -> tuple[list[RequestResult], float, list[float]]:
    ctx = multiprocessing.get_context("spawn")
    caps = split_concurrency(load.max_concurrency, n)
    shares = deal(len(requests), caps)
    conns, procs, finished = [], [], False
    try:
        for share, cap in zip(shares, caps):
            ours, theirs = ctx.Pipe()
            part = dataclasses.replace(load, max_concurrency=cap, client_processes=1)
            proc = ctx.Process(target=_worker, args=(theirs, api, [requests[i] for i in share],
                                                     [offsets[i] for i in share], part), daemon=True)
            proc.start()
            theirs.close()  # so that a dead child reads as EOF here
            conns.append(ours)
            procs.append(proc)
        for k, conn in enumerate(conns):
            _receive(conn, k)
        t0 = time.perf_counter() + START_MARGIN_S
        for conn in conns:
            conn.send(t0)
        answers = [_receive(conn, k) for k, conn in enumerate(conns)]
        finished = True
    finally:
        _stop(procs, wait=finished)
        for conn in conns:
            conn.close()
    results: list[Optional[RequestResult]] = [None] * len(requests)
    for share, (part_results, _, _) in zip(shares, answers):
        for i, result in zip(share, part_results):
            results[i] = result
    return results, max(duration for _, duration, _ in answers), [cpu for _, _, cpu in answers]


def _stop(procs: list, wait: bool) -> None:
    """Join the client processes: after their results, give them a moment to exit; else end them now."""
    for proc in procs:
        proc.join(timeout=10.0 if wait else 0.0)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def _receive(conn, k: int):
    """The next message of client process k: its results (or its readiness); raises if it failed."""
    try:
        message = conn.recv()
    except EOFError:
        raise ClientProcessFailed(f"client process {k} exited before sending its results") from None
    if message[0] == "failed":
        raise ClientProcessFailed(f"client process {k} failed: {message[1]}")
    return message[1:]


def _worker(conn, api: Api, requests: list[BenchRequest], offsets: list[float], load: Load) -> None:
    """A client process: say it is ready, wait for the common start, run its share, send the results."""

    def begin() -> float:
        conn.send(("ready",))
        return conn.recv()

    try:
        conn.send(("done", *asyncio.run(run_share(api, requests, offsets, load, begin))))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group; the parent reports it
        pass
    finally:
        conn.close()
