"""Scheduling flags: defaults, validation messages, and their place in the CLI groups."""

import pytest

from engine.args import EngineArgs, fields_in_groups, group_of
from engine.errors import UsageError

FLAGS = ("max_prefill_tokens", "chunked_prefill_size", "disable_radix_cache", "schedule_policy",
         "disable_overlap_schedule")


def test_defaults():
    a = EngineArgs().validate()
    assert [a.value(name) for name in FLAGS] == [16384, 8192, False, "fcfs", False]


@pytest.mark.parametrize("changes, message", [
    (dict(max_prefill_tokens=0), "--max-prefill-tokens must be >= 1"),
    (dict(chunked_prefill_size=0), "--chunked-prefill-size must be a positive number"),
    (dict(chunked_prefill_size=-5), "--chunked-prefill-size must be a positive number"),
    (dict(schedule_policy="lpm", disable_radix_cache=True), "needs the radix cache"),
    (dict(schedule_policy="random"), "--schedule-policy must be one of fcfs, lpm"),
])
def test_bad_values_are_rejected_with_a_reason(changes, message):
    with pytest.raises(UsageError, match=message):
        EngineArgs.of(**changes).validate()


@pytest.mark.parametrize("changes", [dict(chunked_prefill_size=-1), dict(chunked_prefill_size=None),
                                     dict(chunked_prefill_size=1, max_prefill_tokens=1),
                                     dict(schedule_policy="lpm")])
def test_good_values_pass(changes):
    EngineArgs.of(**changes).validate()


def test_flags_live_in_the_group_of_the_layer_that_reads_them():
    assert {group_of(name) for name in FLAGS} == {"scheduler", "cache"}
    assert group_of("disable_radix_cache") == "cache" and group_of("tp_size") == "parallel"
    names = {f.name for _, f in fields_in_groups(("scheduler", "cache"))}
    assert set(FLAGS) <= names


def test_replace_routes_flat_flags_to_their_groups_and_keeps_the_original():
    base = EngineArgs()
    changed = base.replace(max_prefill_tokens=7, tp_size=2, port=8080)
    assert (changed.scheduler.max_prefill_tokens, changed.parallel.tp_size, changed.server.port) == (7, 2, 8080)
    assert (base.scheduler.max_prefill_tokens, base.parallel.tp_size, base.server.port) == (16384, 1, 30000)
    with pytest.raises(TypeError, match="unknown engine flag"):
        base.replace(no_such_flag=1)


@pytest.mark.parametrize("changes, message", [
    (dict(dp_size=2), "needs --enable-dp-attention"),
    (dict(ep_size=2, tp_size=4), "must equal --tp 4"),
    (dict(enable_dp_attention=True, dp_size=3, tp_size=4), "dividing --tp 4"),
    (dict(nnodes=2, tp_size=2), "needs --dist-init-addr"),
    (dict(tp_size=0), "--tp-size must be >= 1"),
])
def test_parallel_flags_are_checked(changes, message):
    with pytest.raises(UsageError, match=message):
        EngineArgs.of(**changes).validate()
