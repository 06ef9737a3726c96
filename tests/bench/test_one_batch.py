"""`bench one-batch`: every shape is warmed up before it is timed (first-use cost never lands in a figure),
the spread over repeats is reported, and the table fits the terminal in every layout."""

from __future__ import annotations

import json
import math
import time

import pytest
from rich.console import Console

from dsctl.bench_one_batch import bench
from dsctl.bench_one_batch_report import layouts
from dsctl.bench_one_batch_timing import OneBatchResult, RunTimes, percentile, summarize
from dsctl.tables import pick_fitting
from engine.args import EngineArgs
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed.step_floor import step_floor_s
from tests.cli.screen import assert_fits, assert_no_empty_column

FIRST_USE_S = 0.5  # what a shape's first forward costs here (stands for compilation / autotuning / capture)


def test_each_shape_is_warmed_up_before_it_is_timed(monkeypatch, tmp_path):
    """The first forward of every new shape (prefill: batch x tokens; decode: batch) is made slow, as
    compilation is on a GPU; no reported figure may include it."""
    from engine.runner.model_runner import ModelRunner

    seen, first_uses = set(), []
    real_forward = ModelRunner.forward

    def forward(self, fb):
        key = (fb.mode, fb.batch_size, fb.num_tokens)
        if key not in seen:
            seen.add(key)
            first_uses.append(key)
            time.sleep(FIRST_USE_S)
        return real_forward(self, fb)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    out = tmp_path / "r.jsonl"
    args = EngineArgs.of(model="tiny", device="cpu")
    run = bench(args, [1, 3], [5, 9], [3], result_file=out, repeats=2)
    assert len(first_uses) == 4 + 2  # 4 prefill shapes, 2 decode batch sizes: each slow exactly once
    assert [(r.batch_size, r.input_len) for r in run.results] == [(1, 5), (3, 5), (1, 9), (3, 9)]
    for r in run.results:
        assert r.repeats == 2
        assert r.prefill_latency_max_s < FIRST_USE_S, r
        assert r.decode_latency_p90_s < FIRST_USE_S and r.total_latency_s < FIRST_USE_S, r
        assert r.prefill_latency_min_s <= r.prefill_latency_s <= r.prefill_latency_max_s
        assert r.decode_latency_p10_s <= r.median_decode_latency_s <= r.decode_latency_p90_s
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["model"] == "tiny" and rows[0]["device"] == "cpu"
    assert {"prefill_latency_min_s", "prefill_latency_max_s", "decode_latency_p10_s", "decode_latency_p90_s"} <= \
        set(rows[0])
    # CPU: no copy bandwidth, so no floor; the fields are there, empty, and the note says why
    assert (rows[0]["copy_bandwidth_gbs"], rows[0]["decode_floor_ms"], rows[0]["decode_vs_floor"]) == (None,) * 3
    assert "No bytes floor on cpu" in run.note


def test_each_row_has_its_bytes_floor_at_the_measured_bandwidth(monkeypatch, tmp_path):
    """The floor is the layout's decode step bytes (engine/distributed/step_floor.py, context input + output / 2,
    the runner's dtype) at the bandwidth measured before the runner was built (here: stood in for on CPU)."""
    import dsctl.bench_one_batch as one_batch

    monkeypatch.setattr(one_batch, "measure_bandwidth", lambda device: 1e12)
    out = tmp_path / "r.jsonl"
    run = bench(EngineArgs.of(model="tiny", device="cpu"), [1, 4], [8], [5], result_file=out, repeats=1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = parse_config(lookup("tiny").config_dict())
    nbytes = {"float32": 4, "bfloat16": 2}[rows[0]["dtype"]]
    for r, row in zip(run.results, rows):
        floor = step_floor_s(cfg, cfg.num_hidden_layers, r.batch_size, 8 + 5 // 2, nbytes, 1e12, nbytes)
        assert row["copy_bandwidth_gbs"] == 1000 and row["decode_floor_ms"] == pytest.approx(floor * 1e3)
        assert row["decode_vs_floor"] == pytest.approx(row["median_decode_latency_s"] / floor)
    assert run.results[1].decode_floor_ms > run.results[0].decode_floor_ms  # more experts and KV at batch 4
    assert "1000 GB/s copy bandwidth" in run.note


@pytest.mark.parametrize("width", [200, 80, 60])
def test_table_shows_the_floor_when_there_is_one(width):
    results = _results([1, 32], [256], False)
    results[0].decode_floor_ms, results[0].decode_vs_floor = 4.1, 3.0
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(pick_fitting(console, layouts(results, "deepseek-v3, 5 layers, cuda:0 bf16", "floor: the note")))
    text = console.export_text()
    assert_fits(text, width)
    table, = assert_no_empty_column(text)
    cells = " ".join(" ".join(c) for c in table["columns"])
    assert "4.100" in text and "x3.00" in text and "floor: the note" in text
    if width == 200:
        assert {"floor ms", "x floor"} <= set(table["headers"])
        assert table["columns"][table["headers"].index("floor ms")] == ["4.100", "-"]  # a row without: "-"
    elif width == 80:
        assert "floor ms (x floor)" in table["headers"] and "-" in cells
    bare = _results([1], [256], False)  # no floor (CPU): no floor column, only the note
    console.print(pick_fitting(console, layouts(bare, "tiny, 4 layers, cpu float32", "No bytes floor on cpu")))
    text = console.export_text()
    assert "No bytes floor on cpu" in text and "floor ms" not in text


def test_summary_spread_is_over_repeats():
    runs = [RunTimes(0.30, [0.010, 0.012]), RunTimes(0.10, [0.011, 0.020]), RunTimes(0.20, [0.013, 0.014])]
    r = summarize(4, 100, 3, runs)
    assert (r.prefill_latency_min_s, r.prefill_latency_s, r.prefill_latency_max_s) == (0.10, 0.20, 0.30)
    steps = [0.010, 0.012, 0.011, 0.020, 0.013, 0.014]
    assert r.median_decode_latency_s == pytest.approx(0.0125)
    assert r.decode_latency_p10_s == pytest.approx(percentile(steps, 10))
    assert r.decode_latency_p90_s == pytest.approx(percentile(steps, 90))
    assert r.prefill_throughput_tok_s == pytest.approx(400 / 0.20)
    assert r.median_decode_throughput_tok_s == pytest.approx(4 / 0.0125)
    one = summarize(1, 8, 1, [RunTimes(0.1, [])])  # --output-len 1: no decode step
    assert math.isnan(one.median_decode_latency_s)


def _results(batch_sizes, input_lens, big: bool) -> list[OneBatchResult]:
    prefill = 2.708 if big else 0.0123
    return [summarize(bs, il, 32, [RunTimes(prefill * (1 + k / 10), [0.0123 * (1 + j / 50) for j in range(31)])
                                   for k in range(3)]) for bs in batch_sizes for il in input_lens]


@pytest.mark.parametrize("width", [200, 120, 100, 80, 60, 40])
@pytest.mark.parametrize("lens", [[256], [256, 4096]], ids=["one-length", "several-lengths"])
@pytest.mark.parametrize("big", [False, True], ids=["small-figures", "large-figures"])
def test_table_fits_every_width(width, lens, big):
    """The issue's case: several prompt lengths at 80 columns cut "overall" to "overa…"."""
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    table = pick_fitting(console, layouts(_results([1, 32, 128], lens, big), "deepseek-v3, 5 layers, cuda:0 bf16"))
    console.print(table)
    text = console.export_text()
    assert_fits(text, width)
    found = assert_no_empty_column(text)
    if width >= 120:
        assert "overall tok/s" in found[0]["headers"]  # room to spare: the figures get their own columns


def test_prefill_plan_steps_like_the_scheduler():
    """Every prompt token in exactly one forward, at most `budget` new tokens per forward: whole prompts together,
    a longer prompt alone in chunks that continue its cached prefix."""
    from dsctl.bench_one_batch_timing import prefill_plan

    assert prefill_plan(5, 4, 8) == [(0, 2, 0, 4), (2, 2, 0, 4), (4, 1, 0, 4)]
    assert prefill_plan(2, 10, 4) == [(0, 1, 0, 4), (0, 1, 4, 4), (0, 1, 8, 2), (1, 1, 0, 4), (1, 1, 4, 4),
                                      (1, 1, 8, 2)]
    for n, ilen, budget in [(1, 1, 1), (7, 3, 20), (3, 9, 9), (4, 17, 5), (128, 4096, 8192)]:
        plan = prefill_plan(n, ilen, budget)
        covered = sorted((r, p + k) for first, count, p, new in plan for r in range(first, first + count)
                         for k in range(new))
        assert covered == [(r, t) for r in range(n) for t in range(ilen)]
        assert all(count * new <= budget or count == 1 and new <= budget for _, count, _, new in plan)


def test_a_chunked_prefill_gives_the_whole_prefill_tokens_and_cache():
    """One forward for the whole batch and the server's steps (whole prompts two by two, then a long prompt in
    chunks over its cached prefix) write the same KV cache and choose the same next tokens (float32 tiny model)."""
    import torch

    from dsctl.bench_one_batch_timing import prefill, prefill_plan
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(EngineArgs.of(model="tiny", device="cpu", max_total_tokens=256, max_model_len=64))
    prompts = torch.randint(0, 100, (3, 13), generator=torch.Generator().manual_seed(5))
    rows = [runner.req_to_token.alloc() for _ in range(3)]
    slots = runner.kv_pool.alloc(3 * 13).view(3, 13)
    for i, r in enumerate(rows):
        runner.req_to_token.set(r, 0, slots[i])
    caches, tokens = [], []
    for budget in (39, 26, 5):  # one forward; prompts 2 + 1; every prompt in chunks of 5, 5, 3
        tokens.append(prefill(runner, prompts, rows, slots, prefill_plan(3, 13, budget)))
        caches.append(torch.stack([buf[slots.flatten()].clone() for buf in runner.kv_pool.buffer]))
    for got, cache in zip(tokens[1:], caches[1:]):
        assert torch.equal(got, tokens[0])
        torch.testing.assert_close(cache, caches[0], rtol=1e-4, atol=1e-5)
