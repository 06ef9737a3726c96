"""`bench one-batch` over several ranks (--tp 2 with DP attention or EP), as CPU processes joined by gloo.

The ranks time the same static batches in lockstep; rank 0's figures come back. Under DP attention a batch
of one request leaves one DP group without a share: it must join the other group's forwards (else the
collectives would not pair up and the run would hang or fail)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dsctl.bench_one_batch import bench
from dsctl.bench_one_batch_ranks import BenchRankError
from dsctl.bench_one_batch_timing import batch_share, layout_name
from engine.args import EngineArgs
from engine.errors import UsageError

CPU = dict(model="tiny", device="cpu", tp_size=2)


def _tp(dp_size: int, dp_rank: int = 0, size: int = 2, ep_size: int = 1, moe_a2a: str = "none"):
    return SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank, size=size, ep_size=ep_size,
                           exchanges_tokens=moe_a2a != "none")


def test_batch_share_spreads_requests_over_dp_groups():
    assert batch_share(5, _tp(1)) == (0, 5)
    shares = [batch_share(5, _tp(2, g)) for g in range(2)]
    assert shares == [(0, 3), (3, 2)]
    shares = [batch_share(2, _tp(4, g, size=4)) for g in range(4)]
    assert shares == [(0, 1), (1, 1), (2, 0), (2, 0)]  # groups 2 and 3 run idle forwards
    for bs, dp in ((1, 2), (7, 4), (128, 8)):
        got = [batch_share(bs, _tp(dp, g, size=dp)) for g in range(dp)]
        assert sum(n for _, n in got) == bs and [s for s, _ in got] == sorted(s for s, _ in got)


def test_layout_names():
    assert layout_name(_tp(1, size=1)) == "tp1"
    assert layout_name(_tp(2)) == "tp2 dp2"
    assert layout_name(_tp(1, ep_size=2)) == "tp2 ep2"
    assert layout_name(_tp(2, ep_size=2, moe_a2a="torch")) == "tp2 dp2 ep2 a2a"


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", [
    # DP attention with a 4-token prefill budget: 6-token prompts in chunks of 4 + 2; at batch 3 the groups' shares
    # are 2 and 1 (4 and 2 prefill forwards), at batch 1 one group is idle: every collective must still pair up
    (dict(enable_dp_attention=True, dp_size=2, chunked_prefill_size=4), "tp2 dp2"),
    (dict(ep_size=2), "tp2 ep2")])
def test_ranked_bench_times_every_shape(tmp_path, layout, name):
    out = tmp_path / "r.jsonl"
    run = bench(EngineArgs.of(**CPU, **layout), [1, 3], [6], [3], result_file=out, repeats=2)
    assert [(r.batch_size, r.input_len, r.output_len) for r in run.results] == [(1, 6, 3), (3, 6, 3)]
    for r in run.results:
        assert r.repeats == 2 and r.prefill_latency_s > 0 and r.median_decode_latency_s > 0
    assert run.context.endswith(name)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["layout"] for row in rows] == [name, name] and rows[0]["device"] == "cpu"


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_error():
    args = EngineArgs.of(**CPU, max_total_tokens=16)  # the batch needs 3 x 9 KV slots
    with pytest.raises(BenchRankError, match=r"rank \d .*KV pool / request table too small"):
        bench(args, [3], [6], [3], repeats=1)


def test_speculative_bench_over_ranks_is_refused_up_front():
    args = EngineArgs.of(model="tiny-py", device="cpu", tp_size=2, speculative_algorithm="NEXTN")
    with pytest.raises(UsageError, match="bench offline"):
        bench(args, [1], [6], [3], repeats=1)
