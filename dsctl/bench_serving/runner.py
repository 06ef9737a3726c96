"""Load generation in one process: Poisson arrivals (or all at once) under an optional concurrency cap.

Arrival times are drawn up front from a seeded generator, so two runs with the
same --seed send the same requests at the same offsets. Requests waiting for a
concurrency slot start their clock only when sent. Spreading the load over
several processes is processes.py's job.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx
import numpy as np

from dsctl.bench_serving.client import Api, RequestResult, send
from dsctl.bench_serving.datasets import BenchRequest


@dataclass(frozen=True)
class Load:
    request_rate: float = math.inf  # requests per second; inf: all at once
    max_concurrency: Optional[int] = None
    timeout_s: float = 600.0
    client_processes: int = 1  # processes sending the requests (processes.py); 1: this one


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from start) of n requests: Poisson process of `rate`, or all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _client(load: Load, n: int):
    slots = load.max_concurrency or max(n, 1)
    return httpx.AsyncClient(timeout=httpx.Timeout(load.timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots))


async def run_share(api: Api, requests: list[BenchRequest], offsets: list[float], load: Load,
                    begin: Callable[[], float] = time.perf_counter) -> tuple[list[RequestResult], float, float]:
    """This process's load: request i sent `offsets[i]` s after the instant begin() returns.

    begin() is called once the HTTP client is ready and returns a time.perf_counter() instant
    (the default: now). At most load.max_concurrency requests are in flight. Returns the results
    in request order, the seconds from that instant to the last completion, and the CPU seconds
    the loop's thread used meanwhile.
    """
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with _client(load, len(requests)) as client:
        t0, cpu0 = begin(), time.thread_time()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if gate is None:
                return await send(client, api, req, t0)
            async with gate:
                return await send(client, api, req, t0)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
        duration, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    return list(results), duration, cpu


def first_model_card(base_url: str, api_key: Optional[str]) -> dict:
    """The first model the server lists at /v1/models: {"id": ..., and "root" where the server says}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    card = response.json()["data"][0]
    if not isinstance(card.get("id"), str):
        raise ValueError("the first model card has no id")
    return card
