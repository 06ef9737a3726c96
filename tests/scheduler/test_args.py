"""Scheduling flags: defaults, validation messages, and their place in the CLI groups."""

import pytest

from engine.args import MODEL, EngineArgs, fields_in_groups
from engine.errors import UsageError

FLAGS = ("max_prefill_tokens", "chunked_prefill_size", "disable_radix_cache", "schedule_policy",
         "disable_overlap_schedule")


def test_defaults():
    a = EngineArgs().validate()
    assert (a.max_prefill_tokens, a.chunked_prefill_size, a.disable_radix_cache, a.schedule_policy,
            a.disable_overlap_schedule) == (16384, 8192, False, "fcfs", False)


@pytest.mark.parametrize("changes, message", [
    (dict(max_prefill_tokens=0), "--max-prefill-tokens must be >= 1"),
    (dict(chunked_prefill_size=0), "--chunked-prefill-size must be a positive number"),
    (dict(chunked_prefill_size=-5), "--chunked-prefill-size must be a positive number"),
    (dict(schedule_policy="lpm", disable_radix_cache=True), "needs the radix cache"),
    (dict(schedule_policy="random"), "--schedule-policy must be one of fcfs, lpm"),
])
def test_bad_values_are_rejected_with_a_reason(changes, message):
    with pytest.raises(UsageError, match=message):
        EngineArgs(**changes).validate()


@pytest.mark.parametrize("changes", [dict(chunked_prefill_size=-1), dict(chunked_prefill_size=None),
                                     dict(chunked_prefill_size=1, max_prefill_tokens=1),
                                     dict(schedule_policy="lpm")])
def test_good_values_pass(changes):
    EngineArgs(**changes).validate()


def test_flags_are_in_the_model_group_used_by_serve_and_generate():
    names = {f.name for f in fields_in_groups((MODEL,))}
    assert set(FLAGS) <= names
