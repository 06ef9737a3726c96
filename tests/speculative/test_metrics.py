"""Accepted-length metrics: the scheduler's stats, the server's /metrics text, bench one-batch and the
bench serving read-out."""

from types import SimpleNamespace

from engine.args import EngineArgs
from engine.engine import Engine
from engine.runtime.rank_loop import scheduler_stats
from engine.sampling import SamplingParams
from engine.server.metrics import ServerMetrics
from tests.speculative.helpers import FLAGS, SPEC


def test_stats_reach_engine_stats_and_metrics_text():
    eng = Engine(model="tiny", **FLAGS, **SPEC)
    eng.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=SamplingParams(max_new_tokens=5,
                                                                                        temperature=0))
    stats = scheduler_stats(eng.scheduler, eng.runner)
    hist = stats.spec_accept_hist
    assert len(hist) == SPEC["speculative_num_steps"] + 1 and sum(hist) >= 2
    client = SimpleNamespace(stats=stats, healthy=True, pending={}, expert_load=None)
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
    text = ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={}, expert_load=None)).render().decode()
    assert f"dsctl_spec_plain_steps_total {float(stats.spec_plain_steps)}" in text


def test_no_spec_series_without_speculation():
    eng = Engine(model="tiny", **FLAGS)
    stats = scheduler_stats(eng.scheduler, eng.runner)
    text = ServerMetrics(SimpleNamespace(stats=stats, healthy=True, pending={}, expert_load=None)).render().decode()
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


def test_mean_accepted_between_histogram_snapshots():
    from engine.speculative.stats import mean_accepted

    assert mean_accepted((), (2, 0, 2)) == 2.0
    assert mean_accepted((1, 1, 0), (2, 1, 3)) == 2.5  # 1 step of 1 token and 3 of 3 in between
    assert mean_accepted((1, 1), (1, 1)) is None and mean_accepted((), ()) is None


def test_bench_offline_reports_accepted_length_for_one_process_and_tp_ranks():
    """trained tiny-py accepts drafts: the timed runs' mean accepted length, from the Engine's scheduler and,
    with --tp 2, from rank 0's step outputs; the same greedy runs give the same figures. Speculation off: none."""
    from dsctl.bench_offline import run_offline

    flags = dict(model="tiny-py", device="cpu", dtype="float32", speculative_algorithm="NEXTN")
    one = run_offline(EngineArgs.of(**flags), input_len=16, output_len=12, concurrency=3)
    assert one.accept_length_bs1 > 1.5 and one.accept_length > 1.5
    ranked = run_offline(EngineArgs.of(**flags, tp_size=2), input_len=16, output_len=12, concurrency=3)
    assert (ranked.accept_length_bs1, ranked.accept_length) == (one.accept_length_bs1, one.accept_length)
    off = run_offline(EngineArgs.of(model="tiny-py", device="cpu", dtype="float32"), input_len=16, output_len=4,
                      concurrency=2)
    assert off.accept_length_bs1 is None and off.accept_length is None
