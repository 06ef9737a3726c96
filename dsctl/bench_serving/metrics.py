"""Benchmark metrics from per-request results: throughput, latency percentiles, goodput.

All latencies are reported in milliseconds. TTFT, TPOT and end-to-end latency are
per request; ITL pools every inter-chunk gap of every request. Statistics cover
completed requests only; failed ones are counted and their errors kept. Token
totals are what the server counted (usage) where it said; the lengths asked for
are kept beside them, with the number of requests where the two differ.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dsctl.bench_serving.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass
class Stat:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: list[float]) -> Optional["Stat"]:
        if not values_s:
            return None
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass
class Summary:
    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    ttft_ms: Optional[Stat]
    tpot_ms: Optional[Stat]
    itl_ms: Optional[Stat]
    e2e_ms: Optional[Stat]
    goodput: Optional[float] = None  # requests/s meeting every given SLO
    slo_met: Optional[int] = None
    errors: dict = field(default_factory=dict)  # message -> count
    counted_by: dict = field(default_factory=dict)  # usage | tokenizer | estimate -> requests
    asked_input_tokens: int = 0  # what the requests asked for (prompt lengths, max_tokens)
    asked_output_tokens: int = 0
    prompt_len_mismatch: int = 0  # requests whose server-counted (usage) prompt length is not the one asked
    output_len_mismatch: int = 0  # ... whose usage completion_tokens is not max_tokens
    spec_accept_length: Optional[float] = None  # dsctl server with speculative decoding: tokens per request-step
    client_processes: int = 1  # processes that sent the requests
    client_busy: Optional[float] = None  # CPU use of the busiest one's event loop over the run (1.0: a full core)


def meets_slo(r: RequestResult, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > slo_ttft_ms):
        return False
    tpot = r.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def _differs(actual: int, asked: Optional[int], r: RequestResult) -> bool:
    return r.counted_by == "usage" and asked is not None and actual != asked


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: Optional[float] = None,
              slo_tpot_ms: Optional[float] = None) -> Summary:
    ok = [r for r in results if r.ok]
    dur = max(duration_s, 1e-9)
    inp, out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    summary = Summary(
        duration_s=duration_s, completed=len(ok), failed=len(results) - len(ok),
        input_tokens=inp, output_tokens=out,
        request_throughput=len(ok) / dur, input_throughput=inp / dur, output_throughput=out / dur,
        total_throughput=(inp + out) / dur,
        concurrency=sum(r.latency for r in ok) / dur,
        ttft_ms=Stat.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Stat.of([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=Stat.of([gap for r in ok for gap in r.itl]),
        e2e_ms=Stat.of([r.latency for r in ok]),
        errors=dict(Counter(r.error for r in results if not r.ok).most_common()),
        counted_by=dict(Counter(r.counted_by for r in ok)),
        asked_input_tokens=sum(r.asked_prompt_len or 0 for r in ok),
        asked_output_tokens=sum(r.asked_output_len or 0 for r in ok),
        prompt_len_mismatch=sum(_differs(r.prompt_len, r.asked_prompt_len, r) for r in ok),
        output_len_mismatch=sum(_differs(r.output_len, r.asked_output_len, r) for r in ok),
    )
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        summary.slo_met = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        summary.goodput = summary.slo_met / dur
    return summary
