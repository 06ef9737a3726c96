"""Step times per kind: the scheduler records decode, extend and mixed steps (and spec steps), /metrics
exports them as the histogram dsctl_step_seconds, and DP groups' histograms add up."""

from types import SimpleNamespace

from engine.engine import Engine
from engine.runtime.rank_loop import scheduler_stats
from engine.sampling import SamplingParams
from engine.scheduler.step_times import BUCKETS, StepTimes, merge
from engine.server.metrics import ServerMetrics

FLAGS = dict(device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch", max_total_tokens=4096)


def test_buckets_and_merge():
    t = StepTimes()
    t.record("decode", 0.0015)
    t.record("decode", 0.0015)
    t.record("extend", 9.0)
    d = t.as_dict()
    assert set(d) == {"decode", "extend"}
    assert d["decode"][0][BUCKETS.index(0.002)] == 2 and abs(d["decode"][1] - 0.003) < 1e-12
    assert d["extend"][0][-1] == 1  # beyond the last bucket: +Inf
    both = merge([d, d])
    assert both["decode"][0][BUCKETS.index(0.002)] == 4 and both["extend"][1] == 18.0


def test_engine_records_every_step_kind_and_metrics_export_them():
    eng = Engine(model="tiny", enable_mixed_chunk=True, chunked_prefill_size=16, **FLAGS)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    eng.generate(input_ids=[list(range(3, 40))], sampling_params=params)  # chunks, then decodes
    sched = eng.scheduler
    sched.add(eng.make_request(list(range(5, 9)), params))
    sched.step()  # the short prompt's prefill
    sched.add(eng.make_request(list(range(7, 60)), params))
    while sched.has_work():
        sched.step()
    sched.flush()
    steps = sched.stats()["step_seconds"]
    assert {"decode", "extend", "mixed"} <= set(steps)
    counts = {k: sum(c) for k, (c, _) in steps.items()}
    c = sched.stats()
    assert counts["decode"] == c["decode_steps"] and counts["mixed"] == c["mixed_steps"]
    assert counts["extend"] + counts["mixed"] == c["extend_steps"]
    assert all(total > 0 for _, total in steps.values())
    stats = scheduler_stats(sched, eng.runner)
    text = ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={}, expert_load=None)).render().decode()
    assert f'dsctl_step_seconds_count{{kind="decode"}} {float(counts["decode"])}' in text
    assert 'dsctl_step_seconds_bucket{kind="mixed",le="+Inf"}' in text


def test_step_times_script_reads_the_window_between_two_scrapes():
    from benchmarks.step_times import parse, table
    from engine.runtime.protocol import EngineStats

    t = StepTimes()
    t.record("decode", 0.004)

    def scrape():
        stats = EngineStats(step_seconds=t.as_dict())
        return ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={}, expert_load=None)).render().decode()

    before = scrape()
    for _ in range(99):
        t.record("decode", 0.008)
    t.record("decode", 0.04)
    t.record("extend", 0.12)
    lines = table(parse(before), parse(scrape()))
    decode = next(x for x in lines if x.startswith("decode")).split()
    assert decode[1] == "100" and abs(float(decode[2]) - (99 * 8 + 40) / 100) < 1e-6
    assert " ".join(decode[3:9]) == "<= 10 ms <= 10 ms"
    assert decode[9:] == ["1", "0", "0", "0", "0"]  # steps over 30, 50, 100, 200, 500 ms: the 40 ms one
    assert next(x for x in lines if x.startswith("extend")).split()[1] == "1"


def test_a_slow_decode_step_is_logged_with_the_host_work_before_it(monkeypatch, caplog):
    """A decode step far over the recent decode steps is a stall every running stream sees: it is logged with
    the batch and the host's processing of the step before it (thresholds lowered here, so that every decode
    step counts as slow)."""
    import logging

    import engine.scheduler.scheduler as scheduler_module

    eng = Engine(model="tiny", **FLAGS)
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (3, 8)]
    with caplog.at_level(logging.WARNING, logger="engine.scheduler.scheduler"):
        monkeypatch.setattr(scheduler_module, "SLOW_DECODE_S", 0.0)
        eng.scheduler.prefill_budget.decode_s = 1e-9
        monkeypatch.setattr(eng.scheduler.prefill_budget, "observe", lambda *a: None)
        eng.generate(input_ids=[list(range(3, 12)), list(range(4, 20))], sampling_params=params)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("a decode step of ") for line in lines), lines
    assert any("released 1 finished requests" in line for line in lines), lines  # the 3-token request's end
