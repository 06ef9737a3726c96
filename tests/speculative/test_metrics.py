"""Accepted-length metrics: the scheduler's stats, the server's /metrics text, bench one-batch and the
bench serving read-out."""

from types import SimpleNamespace

from engine.args import EngineArgs
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.server.engine_process import scheduler_stats
from engine.server.metrics import ServerMetrics
from tests.speculative.helpers import FLAGS, SPEC


def test_stats_reach_engine_stats_and_metrics_text():
    eng = Engine(model="tiny", **FLAGS, **SPEC)
    eng.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=SamplingParams(max_new_tokens=5,
                                                                                        temperature=0))
    stats = scheduler_stats(eng.scheduler, eng.runner)
    hist = stats.spec_accept_hist
    assert len(hist) == SPEC["speculative_num_steps"] + 1 and sum(hist) >= 2
    client = SimpleNamespace(stats=stats, healthy=True, pending={})
    text = ServerMetrics(client).render().decode()
    assert f"dsctl_spec_accepted_tokens_count {float(sum(hist))}" in text
    tokens = sum((i + 1) * c for i, c in enumerate(hist))
    assert f"dsctl_spec_accepted_tokens_sum {float(tokens)}" in text
    assert "dsctl_spec_accept_length" in text


def test_plain_steps_reach_metrics_text():
    eng = Engine(model="tiny", **FLAGS, **SPEC, speculative_disable_by_batch_size=2)
    eng.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=SamplingParams(max_new_tokens=5,
                                                                                        temperature=0))
    stats = scheduler_stats(eng.scheduler, eng.runner)
    assert stats.spec_plain_steps >= 4
    text = ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={})).render().decode()
    assert f"dsctl_spec_plain_steps_total {float(stats.spec_plain_steps)}" in text


def test_no_spec_series_without_speculation():
    eng = Engine(model="tiny", **FLAGS)
    stats = scheduler_stats(eng.scheduler, eng.runner)
    text = ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={})).render().decode()
    assert "dsctl_spec" not in text


def test_bench_one_batch_reports_accepted_length():
    from dsctl.bench_one_batch import bench

    args = EngineArgs.of(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                         moe_backend="torch", **SPEC)
    run = bench(args, [2], 8, 4, repeats=1)
    r = run.results[0]
    assert r.accept_length is not None and 1.0 <= r.accept_length <= SPEC["speculative_num_steps"] + 1
    assert "accepted length" in run.context


def test_bench_serving_accept_length_from_counters():
    from dsctl.bench_serving.server_metrics import accept_length

    assert accept_length((10.0, 5.0), (40.0, 15.0)) == 3.0
    assert accept_length(None, (1.0, 1.0)) is None and accept_length((1.0, 1.0), (1.0, 1.0)) is None
