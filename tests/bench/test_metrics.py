"""Metrics from synthetic per-request results, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from dsctl.bench_serving.client import RequestResult
from dsctl.bench_serving.metrics import summarize


def ok(ttft, gaps, prompt=10, start=0.0):
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(True, prompt, len(times), start, latency=times[-1] + 0.001, ttft=ttft, chunk_times=times,
                         counted_by="usage")


def test_summary_statistics():
    results = [ok(0.1 * (i + 1), [0.01 * (i + 1)] * 3) for i in range(10)]  # TTFT 100..1000 ms
    results.append(RequestResult(False, 10, 0, 0.0, 0.5, error="HTTP 500: boom"))
    s = summarize(results, duration_s=4.0)
    assert (s.completed, s.failed) == (10, 1)
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.ttft_ms.mean == pytest.approx(550.0)
    assert s.ttft_ms.median == pytest.approx(550.0)
    assert s.ttft_ms.p90 == pytest.approx(910.0)  # linear interpolation: 900 + 0.1 * (1000 - 900)
    assert s.ttft_ms.p99 == pytest.approx(991.0)
    # 30 pooled gaps, three each of 10..100 ms
    assert s.itl_ms.median == pytest.approx(55.0) and s.itl_ms.mean == pytest.approx(55.0)
    # TPOT of request i: (latency - ttft) / (4 - 1) = (3 * gap + 1 ms) / 3
    assert s.tpot_ms.mean == pytest.approx((3 * 55.0 + 1.0) / 3)
    assert s.output_tokens == 40 and s.input_tokens == 100  # the failed request counts nowhere
    assert s.output_throughput == pytest.approx(10.0) and s.request_throughput == pytest.approx(2.5)
    assert s.total_throughput == pytest.approx(35.0)
    assert s.concurrency == pytest.approx(sum(r.latency for r in results[:10]) / 4.0)
    assert s.goodput is None


def test_goodput_applies_every_slo_and_skips_failures():
    fast = ok(0.05, [0.01, 0.01])  # TTFT 50 ms, TPOT ~10.5 ms
    slow_first = ok(0.5, [0.01, 0.01])
    slow_tokens = ok(0.05, [0.2, 0.2])
    one_token = RequestResult(True, 5, 1, 0.0, 0.06, ttft=0.05, chunk_times=[0.05])  # no TPOT: meets the TPOT SLO
    failed = RequestResult(False, 5, 0, 0.0, 0.01, error="x")
    results = [fast, slow_first, slow_tokens, one_token, failed]
    both = summarize(results, 2.0, slo_ttft_ms=100, slo_tpot_ms=50)
    assert both.slo_met == 2 and both.goodput == pytest.approx(1.0)
    only_ttft = summarize(results, 2.0, slo_ttft_ms=100)
    assert only_ttft.slo_met == 3
    only_tpot = summarize(results, 2.0, slo_tpot_ms=50)
    assert only_tpot.slo_met == 3


def test_no_completed_request_gives_empty_stats():
    s = summarize([RequestResult(False, 3, 0, 0.0, 0.1, error="e")], 1.0)
    assert s.completed == 0 and s.ttft_ms is None and s.itl_ms is None and s.errors == {"e": 1}


def test_throughput_series_spreads_tokens_over_chunks():
    from dsctl.bench_serving.plot import throughput_series

    a = RequestResult(True, 1, 4, start=0.0, latency=1.5, ttft=0.2, chunk_times=[0.2, 0.6, 1.2, 1.4])
    b = RequestResult(True, 1, 6, start=1.0, latency=1.0, ttft=0.5, chunk_times=[0.5, 1.5])  # 3 tokens per chunk
    t, rate = throughput_series([a, b, RequestResult(False, 1, 0, 0.0, 0.1, error="x")])
    assert t.tolist() == [0.0, 1.0, 2.0]
    assert rate.tolist() == [2.0, 5.0, 3.0]
