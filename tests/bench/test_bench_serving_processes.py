"""`dsctl bench serving --client-processes`: the load spread over spawned client processes gives the
same per-request results as one process, under the same total concurrency cap, from one common start."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from dsctl.bench_serving import main as bench_main
from dsctl.bench_serving.client import RequestResult
from dsctl.bench_serving.datasets import BenchRequest, jsonl_requests
from dsctl.bench_serving.main import ServingOptions, run_serving
from dsctl.bench_serving.processes import client_processes, deal, resolve_processes, split_concurrency
from tests.bench.conftest import run_bench

SLACK = 0.06  # scheduling on a busy 2-core machine only makes times longer
WAKE = 0.25  # ... and a process woken by a pipe later still


@pytest.fixture
def captured(monkeypatch):
    """The per-request results and duration of each benchmark run made in a test."""
    runs = []
    real = bench_main.run_load

    def spy(*args, **kwargs):
        results, duration = real(*args, **kwargs)
        runs.append((results, duration))
        return results, duration

    monkeypatch.setattr(bench_main, "run_load", spy)
    return runs


def _quiet() -> Console:
    return Console(file=open("/dev/null", "w"))


def test_automatic_process_count():
    assert client_processes(256, 1000, cpus=16) == 4  # one per 64 in flight
    assert client_processes(65, 1000, cpus=16) == 2
    assert client_processes(64, 1000, cpus=16) == 1
    assert client_processes(256, 1000, cpus=5) == 2  # at most half of the CPUs
    assert client_processes(256, 1000, cpus=1) == 1  # at least one
    assert client_processes(512, 3, cpus=64) == 3  # at most one per request
    assert client_processes(None, 200, cpus=16) == 4  # no cap: every request is in flight
    assert resolve_processes(8, 3, 100) == 3  # asked, but never more than the concurrency slots
    assert resolve_processes(8, None, 5) == 5  # ... or the requests
    assert resolve_processes(0, 64, 100) == 1  # 0: automatic


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.integers(1, 16), st.integers(0, 400))
def test_concurrency_split_and_deal(total, n, n_requests):
    n = min(n, total)
    caps = split_concurrency(total, n)
    assert sum(caps) == total and max(caps) - min(caps) <= 1 and min(caps) >= 1
    shares = deal(n_requests, caps)
    assert sorted(i for share in shares for i in share) == list(range(n_requests))
    assert all(share == sorted(share) for share in shares)
    # in proportion to the caps: over each run of `total` requests, process k gets exactly caps[k]
    full = n_requests // total
    assert all(full * cap <= len(share) <= (full + 1) * cap for share, cap in zip(shares, caps))
    assert deal(n_requests, split_concurrency(None, n)) == [list(range(k, n_requests, n)) for k in range(n)]


def test_results_pickle():
    rng = np.random.default_rng(5)
    times = np.cumsum(rng.uniform(0.001, 0.05, size=int(rng.integers(3, 40)))).tolist()
    ok = RequestResult(True, int(rng.integers(1, 99)), len(times), float(rng.uniform()), times[-1] + 0.01,
                       times[0], times, counted_by="usage", asked_prompt_len=7, asked_output_len=len(times))
    failed = RequestResult(False, 3, 0, 0.5, 0.1, error="HTTP 500: boom", asked_prompt_len=3, asked_output_len=9)
    assert pickle.loads(pickle.dumps([ok, failed])) == [ok, failed]


def test_client_processes_import_no_torch():
    # a spawned client process imports the dsctl CLI (the entry script) and the load modules, never torch
    code = ("import sys, dsctl.cli, dsctl.bench_serving.processes, dsctl.bench_serving.main; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _dataset(tmp_path, n: int) -> tuple[Path, list[BenchRequest]]:
    """JSONL prompts of random output lengths, with one request the server fails; and the requests made of it."""
    rng = np.random.default_rng(11)
    rows = [{"prompt": "FAIL this" if i == 3 else f"prompt {i} " + "w " * int(rng.integers(1, 9)),
             "output_len": int(rng.integers(2, 10))} for i in range(n)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, jsonl_requests(path, n, seed=0, tok=None)


def test_processes_give_the_results_of_one_process_under_the_same_cap(make_server, captured, tmp_path):
    server = make_server(ttft=0.1, itl=0.01)  # requests overlap even when a process wakes late
    path, requests = _dataset(tmp_path, 11)
    lens, fine = [q.output_len for q in requests], ["FAIL" not in q.prompt for q in requests]
    assert len(set(lens)) > 2 and fine.count(False) == 1
    per_run = []
    for processes in (1, 2, 3):
        server.max_in_flight = 0
        opts = ServingOptions(base_url=server.url, dataset="jsonl", dataset_path=path, num_prompts=11,
                              max_concurrency=5, client_processes=processes)
        summary = run_serving(opts, _quiet())
        results, duration = captured[-1]
        assert summary.client_processes == processes
        assert (summary.completed, summary.failed) == (10, 1)
        assert server.max_in_flight == 5  # the shares add up to the cap, and run together
        # request order and per-request counts: the server streams max_tokens chunks and reports them in usage
        assert [r.asked_output_len for r in results] == lens
        assert [r.ok for r in results] == fine
        assert all(r.output_len == len(r.chunk_times) == k for r, k in zip(results, lens) if r.ok)
        # one common start: the first wave of every process starts at 0 (a spawned process may wake late on a
        # busy machine), the duration ends at the last completion
        assert all(0 <= r.start for r in results) and sorted(r.start for r in results)[4] <= WAKE
        assert max(r.start + r.latency for r in results) <= duration <= max(r.start + r.latency for r in results) + SLACK
        per_run.append([(r.ok, r.prompt_len, r.output_len, r.asked_prompt_len, r.error) for r in results])
    assert per_run[0] == per_run[1] == per_run[2]


def test_cli_reports_processes_and_counts_tokens_without_usage(make_server, captured, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "tok": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    server = make_server(ttft=0.02, itl=0.005, send_usage=False)
    out = tmp_path / "r.jsonl"
    r = run_bench("serving", "--base-url", server.url, "--num-prompts", "5", "--max-concurrency", "4",
                  "--random-input-len", "6", "--random-output-len", "7", "--random-range-ratio", "0.3",
                  "--tokenizer", str(tmp_path), "--client-processes", "2", "--result-file", str(out))
    assert r.exit_code == 0, r.output
    assert "client_processes=2" in r.output and "client processes" in r.output
    rec = json.loads(out.read_text())
    assert rec["client_processes"] == 2 and rec["flags"]["client_processes"] == 2
    assert 0 <= rec["client_busy"] < 1.5
    results, _ = captured[-1]
    # counted afterwards, in the parent, with the tokenizer: one "tok" per streamed chunk
    assert [x.counted_by for x in results] == ["tokenizer"] * 5
    assert [x.output_len for x in results] == [x.asked_output_len for x in results]
    assert len({x.asked_output_len for x in results}) > 1 and all(x.text is None for x in results)
    assert rec["output_tokens"] == sum(x.asked_output_len for x in results)


def test_a_busy_client_is_warned_about():
    from dsctl.bench_serving.metrics import summarize
    from dsctl.bench_serving.report import client_warnings

    rng = np.random.default_rng(2)
    s = summarize([RequestResult(True, 4, 3, 0.0, 1.0, 0.2, [0.2, 0.5, 0.9])], float(rng.uniform(2, 9)))
    s.client_processes = 3
    for busy, warned in ((0.95, True), (float(rng.uniform(0.1, 0.85)), False), (None, False)):
        s.client_busy = busy
        assert bool(client_warnings(s)) == warned
    s.client_busy = 0.97
    assert "busiest of 3 client process(es) used 97% of a CPU" in client_warnings(s)[0]
    assert client_warnings(s, min_duration_s=s.duration_s + 1) == []  # too short a run to judge


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=12), st.sampled_from(["\n", "\r\n"]),
       st.lists(st.integers(1, 40), max_size=30))
def test_stream_events_parse_any_split_of_the_bytes(texts, eol, cuts):
    from dsctl.bench_serving.client import StreamEvents

    events = [{"choices": [{"index": 0, "text": t}]} for t in texts] + [{"choices": [], "usage": {"completion_tokens": 9}}]
    body = "".join(f"data: {json.dumps(e)}{eol}{eol}" for e in events) + f": keep-alive{eol}data: [DONE]{eol}{eol}"
    data, parsed, at = body.encode(), StreamEvents("completions", start=0.0), 0
    for k, cut in enumerate(cuts + [len(body.encode())]):  # the bytes as reads of random sizes
        parsed.feed(data[at:at + cut], now=float(k + 1))
        at += cut
    parsed.feed(data[at:], now=99.0)
    assert parsed.pieces == texts and parsed.done and parsed.usage == {"completion_tokens": 9}
    assert parsed.times == sorted(parsed.times) and len(parsed.times) == len(texts)
