"""The DP-attention controller (engine/runtime/dp_controller.py): which DP group gets each request, and the
job-wide stats it merges from every group's."""

import pytest

from engine.runtime.dp_controller import DPController
from engine.runtime.protocol import AbortRequest, AddRequest, EngineStats, Shutdown
from engine.sampling import SamplingParams


def _add(i: int, dp_rank=None) -> AddRequest:
    return AddRequest(f"r{i}", [1, 2, 3], SamplingParams(), dp_rank=dp_rank)


def test_round_robin_and_broadcast_messages():
    c = DPController(3)
    assert [c.route(_add(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.route(AbortRequest("r1")) is None and c.route(Shutdown()) is None  # every group
    assert c.route(_add(9, dp_rank=2)) == 2  # a named group wins
    assert c.dispatched == [3, 2, 3]
    with pytest.raises(ValueError):
        c.route(_add(10, dp_rank=3))


def test_shortest_queue_follows_reported_load():
    c = DPController(2, "shortest_queue")
    c.merge_stats([EngineStats(running=5, waiting=2), EngineStats(running=1)])
    assert [c.route(_add(i)) for i in range(7)] == [1] * 6 + [0]  # group 1 fills up to group 0's 7, then ties
    merged = c.merge_stats([EngineStats(running=3, kv_total_tokens=10, kv_free_tokens=4, prefix_cache_hit_rate=0.5),
                            EngineStats(waiting=2, kv_total_tokens=10, kv_free_tokens=6)])
    assert (merged.running, merged.waiting, merged.kv_total_tokens, merged.kv_free_tokens) == (3, 2, 20, 10)
    assert merged.prefix_cache_hit_rate == 0.25 and merged.dp_requests == (1, 6) and merged.dp_running == (3, 2)
    assert c.route(_add(8)) == 1


def test_merged_stats_add_up_every_groups_speculative_acceptance():
    """Each DP group runs its own spec steps: the job's histogram of accepted tokens is the groups' sum."""
    c = DPController(2, "round_robin")
    merged = c.merge_stats([EngineStats(spec_accept_hist=(5, 1, 0), spec_plain_steps=2),
                            EngineStats(spec_accept_hist=(1, 2, 3), spec_plain_steps=1)])
    assert merged.spec_accept_hist == (6, 3, 3) and merged.spec_plain_steps == 3
    assert c.merge_stats([EngineStats(), EngineStats()]).spec_accept_hist == ()


def test_unknown_policy():
    with pytest.raises(ValueError):
        DPController(2, "random")
