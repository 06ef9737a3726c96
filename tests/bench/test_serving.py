"""`dsctl bench serving` against the fake OpenAI server: timing metrics, failures, load shape, outputs."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from dsctl.bench_serving.main import BenchFailed, ServingOptions, run_serving
from tests.bench.conftest import run_bench

TTFT, ITL, SLOW = 0.2, 0.03, 0.25
N_TOKENS, SLOW_INDEX = 8, 4
# Scheduling on a busy 2-core machine only makes gaps longer; the fake server's sleeps may end up to a
# millisecond early (uvicorn runs it on uvloop, whose timers count whole milliseconds of a cached clock).
SLACK, EARLY = 0.06, 0.002


def _quiet() -> Console:
    return Console(file=open("/dev/null", "w"))


def _jsonl(tmp_path, prompts) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": N_TOKENS}) + "\n" for p in prompts))
    return str(path)


def test_metrics_match_the_servers_known_timing(make_server):
    server = make_server(ttft=TTFT, itl=ITL, slow_index=SLOW_INDEX, slow_gap=SLOW)
    opts = ServingOptions(base_url=server.url + "/v1", num_prompts=6, max_concurrency=3, random_input_len=16,
                          random_output_len=N_TOKENS, seed=1)
    s = run_serving(opts, _quiet())
    assert (s.completed, s.failed) == (6, 0)
    assert s.output_tokens == 6 * N_TOKENS and s.counted_by == {"usage": 6}
    assert s.input_tokens == sum(len(b["prompt"].split()) for b in server.bodies)
    gaps = [ITL] * (N_TOKENS - 2) + [SLOW]  # per request: 6 normal gaps and one slow one
    e2e = TTFT + sum(gaps)
    tpot = sum(gaps) / (N_TOKENS - 1)
    assert (TTFT - EARLY) * 1e3 <= s.ttft_ms.median <= (TTFT + SLACK) * 1e3
    assert (ITL - EARLY) * 1e3 <= s.itl_ms.median <= (ITL + SLACK / 2) * 1e3
    # 6 of 42 pooled gaps are slow: p90 and p99 land on them, the median does not
    assert (SLOW - EARLY) * 1e3 <= s.itl_ms.p90 <= (SLOW + SLACK) * 1e3
    assert (SLOW - EARLY) * 1e3 <= s.itl_ms.p99 <= (SLOW + SLACK) * 1e3
    assert (sum(gaps) / len(gaps) - EARLY) * 1e3 <= s.itl_ms.mean <= (sum(gaps) / len(gaps) + SLACK / 2) * 1e3
    assert (tpot - EARLY) * 1e3 <= s.tpot_ms.mean <= (tpot + SLACK / 2) * 1e3
    assert (e2e - EARLY * N_TOKENS) * 1e3 <= s.e2e_ms.median <= (e2e + SLACK * 2) * 1e3
    # two waves of 3 concurrent requests
    assert 2 * (e2e - EARLY * N_TOKENS) <= s.duration_s <= 2 * e2e + 4 * SLACK
    assert s.output_throughput == pytest.approx(s.output_tokens / s.duration_s)
    assert 2.5 <= s.concurrency <= 3.0
    assert server.max_in_flight == 3


def test_request_file_holds_each_requests_chunk_times(make_server, tmp_path):
    """--request-file: one line per request whose chunk times show the server's known gaps (the slow one too)."""
    server = make_server(ttft=TTFT, itl=ITL, slow_index=SLOW_INDEX, slow_gap=SLOW)
    path = tmp_path / "requests.jsonl"
    opts = ServingOptions(base_url=server.url, num_prompts=3, max_concurrency=3, random_input_len=8,
                          random_output_len=N_TOKENS, request_file=path)
    run_serving(opts, _quiet())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all(r["ok"] and r["output_len"] == N_TOKENS for r in lines)
    for r in lines:
        times = r["chunk_times"]
        assert len(times) == N_TOKENS and times[0] == pytest.approx(r["ttft"])
        gaps = [b - a for a, b in zip(times, times[1:])]
        slow = max(range(len(gaps)), key=gaps.__getitem__)
        assert SLOW - EARLY <= gaps[slow] <= SLOW + SLACK
        assert all(ITL - EARLY <= g <= ITL + SLACK for i, g in enumerate(gaps) if i != slow)


def test_goodput_counts_requests_within_slo(make_server):
    server = make_server(ttft=0.05, itl=0.01)
    base = dict(base_url=server.url, num_prompts=4, random_input_len=8, random_output_len=4)
    loose = run_serving(ServingOptions(**base, slo_ttft_ms=5000, slo_tpot_ms=5000), _quiet())
    strict = run_serving(ServingOptions(**base, slo_ttft_ms=10), _quiet())  # below the 50 ms TTFT
    assert loose.slo_met == 4 and loose.goodput == pytest.approx(4 / loose.duration_s)
    assert strict.slo_met == 0 and strict.goodput == 0.0


def test_failures_are_counted_and_shown_with_their_error(make_server, tmp_path):
    server = make_server(ttft=0.01, itl=0.005)
    prompts = ["hello there", "FAIL please", "CUT me", "ERREVENT here", "good one", "fine"]
    r = run_bench("serving", "--base-url", server.url, "--dataset", "jsonl", "--dataset-path",
                  _jsonl(tmp_path, prompts), "--num-prompts", "6", "--result-file", str(tmp_path / "r.jsonl"))
    assert r.exit_code == 0, r.output
    assert "3 failed request(s)" in r.output
    assert "HTTP 500: injected failure" in r.output and "injected error event" in r.output
    rec = json.loads((tmp_path / "r.jsonl").read_text())
    assert (rec["completed"], rec["failed"]) == (3, 3)
    assert sum(rec["errors"].values()) == 3
    assert any("RemoteProtocolError" in e or "stream ended" in e for e in rec["errors"])


def test_all_requests_failing_is_an_error(make_server, tmp_path):
    server = make_server()
    opts = ServingOptions(base_url=server.url, dataset="jsonl", dataset_path=_jsonl(tmp_path, ["FAIL"]),
                          num_prompts=2)
    with pytest.raises(BenchFailed, match="all 2 requests failed; first error: HTTP 500"):
        run_serving(opts, _quiet())


def test_poisson_arrivals_start_requests_on_schedule(make_server, monkeypatch):
    from dsctl.bench_serving import main as bench_main
    from dsctl.bench_serving.runner import arrival_offsets

    server = make_server(ttft=0.01, itl=0.005)
    captured = {}
    real = bench_main.run_load

    def spy(*args, **kwargs):
        captured["results"], duration = real(*args, **kwargs)
        return captured["results"], duration

    monkeypatch.setattr(bench_main, "run_load", spy)
    run_serving(ServingOptions(base_url=server.url, num_prompts=10, request_rate="20", random_input_len=4,
                               random_output_len=2, seed=7), _quiet())
    offsets = arrival_offsets(10, 20.0, 7)
    starts = [r.start for r in captured["results"]]
    assert all(o <= s <= o + SLACK for o, s in zip(offsets, starts))
    assert offsets[-1] > 0.1  # the schedule really spreads the requests out


def test_arrival_offsets_are_poisson_and_seeded():
    import math

    from dsctl.bench_serving.runner import arrival_offsets

    offsets = arrival_offsets(4000, 50.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.06)
    # exponential gaps: about e^-1 of them exceed the mean
    assert sum(g > 1 / 50.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert offsets == arrival_offsets(4000, 50.0, seed=3)
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_chat_endpoint_without_usage_counts_chunks(make_server):
    server = make_server(ttft=0.01, itl=0.005, send_usage=False)
    s = run_serving(ServingOptions(base_url=server.url, endpoint="chat", num_prompts=3, random_input_len=5,
                                   random_output_len=N_TOKENS), _quiet())
    assert s.completed == 3 and s.counted_by == {"estimate": 3}
    assert s.output_tokens == 3 * N_TOKENS
    assert all("messages" in b and b["max_tokens"] == N_TOKENS and b["stream"] for b in server.bodies)


def test_tokenizer_counts_tokens_when_usage_is_missing(make_server, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "tok": 1, **{f"w{i}": i + 2 for i in range(50)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    server = make_server(ttft=0.01, itl=0.005, send_usage=False)
    s = run_serving(ServingOptions(base_url=server.url, num_prompts=2, random_input_len=12, random_output_len=5,
                                   tokenizer=str(tmp_path)), _quiet())
    assert s.counted_by == {"tokenizer": 2} and s.output_tokens == 10  # five "tok " chunks each
    # with a tokenizer, random prompts go out as token ids of the tokenizer's vocabulary
    sent = [b["prompt"] for b in server.bodies if b.get("stream")]
    assert len(sent) == 2 and all(len(p) == 12 and set(p) <= set(vocab.values()) for p in sent)
    assert s.input_tokens == 24 and s.asked_input_tokens == 24  # no usage: the asked lengths stand


def test_result_file_gets_one_json_line_per_run_and_plot_is_written(make_server, tmp_path):
    server = make_server(ttft=0.01, itl=0.005)
    out, png = tmp_path / "res" / "out.jsonl", tmp_path / "plot.png"
    args = ("serving", "--base-url", server.url, "--model", "fake-model", "--num-prompts", "4",
            "--random-input-len", "8", "--random-output-len", "4", "--result-file", str(out))
    assert run_bench(*args).exit_code == 0
    r = run_bench(*args, "--plot", str(png), "--warmup", "2", "--request-rate", "100")
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2
    assert lines[1]["flags"]["request_rate"] == "100" and lines[1]["flags"]["num_prompts"] == 4
    assert lines[0]["flags"]["request_rate"] == "inf" and lines[0]["timestamp"]
    assert lines[1]["completed"] == 4 and lines[1]["ttft_ms"]["median"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert server.requests == 4 + 2 + 4  # the warmup requests were sent, but not counted


def test_plot_without_matplotlib_fails_before_sending(make_server, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    server = make_server()
    r = run_bench("serving", "--base-url", server.url, "--num-prompts", "2", "--plot", str(tmp_path / "p.png"))
    assert r.exit_code != 0 and "--plot needs matplotlib" in r.output
    assert server.requests == 0


def test_model_is_discovered_from_v1_models(make_server):
    server = make_server(ttft=0.01, itl=0.005)
    run_serving(ServingOptions(base_url=server.url, num_prompts=1, random_input_len=4, random_output_len=2), _quiet())
    assert server.bodies[0]["model"] == "fake-model" and server.bodies[0]["ignore_eos"] is True
