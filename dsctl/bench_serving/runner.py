"""Load generation: Poisson arrivals (or all at once) under an optional concurrency cap.

Arrival times are drawn up front from a seeded generator, so two runs with the
same --seed send the same requests at the same offsets. Requests waiting for a
concurrency slot start their clock only when sent.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Optional

import httpx
import numpy as np

from dsctl.bench_serving.client import Api, RequestResult, send
from dsctl.bench_serving.datasets import BenchRequest
from dsctl.bench_serving.tokens import TokenCounter


@dataclass(frozen=True)
class Load:
    request_rate: float = math.inf  # requests per second; inf: all at once
    max_concurrency: Optional[int] = None
    timeout_s: float = 600.0


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


async def _run(api: Api, requests: list[BenchRequest], load: Load, seed: int,
               tok: Optional[TokenCounter]) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(requests), load.request_rate, seed)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with _client(load, len(requests)) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if gate is None:
                return await send(client, api, req, t0, tok)
            async with gate:
                return await send(client, api, req, t0, tok)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
        duration = time.perf_counter() - t0
    return list(results), duration


def run_load(api: Api, requests: list[BenchRequest], load: Load, seed: int,
             tok: Optional[TokenCounter] = None) -> tuple[list[RequestResult], float]:
    """Results in request order, and the wall time from the first send to the last completion."""
    return asyncio.run(_run(api, requests, load, seed, tok))


def first_model_card(base_url: str, api_key: Optional[str]) -> dict:
    """The first model the server lists at /v1/models: {"id": ..., and "root" where the server says}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    card = response.json()["data"][0]
    if not isinstance(card.get("id"), str):
        raise ValueError("the first model card has no id")
    return card
