"""A step that raises fails the requests of its batch, not the scheduler (tiny model, CPU).

The forward is made to fail by `FailingRunner`, passed to the Scheduler in place of the model runner; it
scribbles over the KV the step would have written before raising. The requests of the failed batch finish
with reason "error" and the message; the others go on; KV accounting is exact afterwards; nothing the
failed step wrote is cached (the same prompts then give the reference outputs); new requests are served.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SampleResult, SamplingParams
from engine.scheduler import scheduler as scheduler_module
from engine.scheduler.processor import OutputProcessor
from engine.scheduler.request import Request
from tests.scheduler.failing_runner import POISON, FailingRunner, NthDecode, poisoned_prefill, use_runner
from tests.scheduler.helpers import assert_settled, drop_scheduler

BASELINE = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True)
MODES = [dict(), dict(disable_overlap_schedule=True), dict(disable_radix_cache=True)]
MODE_IDS = ["overlap", "no-overlap", "no-radix"]


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(5, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _greedy(n=8):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _fresh(engine, when, **flags):
    """A scheduler over FailingRunner(when); the previous scheduler's cached KV is evicted first."""
    drop_scheduler(engine)
    return use_runner(engine, FailingRunner(engine.runner, when), **flags)


def _reference(engine, prompts, n=8):
    sched = _fresh(engine, lambda fb: False, **BASELINE)
    out = engine.generate(input_ids=prompts, sampling_params=_greedy(n))
    assert sched.stats()["failed_steps"] == 0
    return [o.token_ids for o in out]


@pytest.mark.parametrize("flags", MODES, ids=MODE_IDS)
def test_a_failed_prefill_fails_its_batch_and_the_engine_goes_on(engine, flags):
    prompts = _prompts(4, seed=1)
    ref = _reference(engine, prompts)
    sched = _fresh(engine, poisoned_prefill, **flags)
    batch = prompts + [[POISON] + prompts[0][1:]]  # one prefill step holds all five
    out = engine.generate(input_ids=batch, sampling_params=_greedy())
    assert [o.finish_reason for o in out] == ["error"] * 5
    assert all("injected failure" in o.error and o.token_ids == [] for o in out)
    stats = sched.stats()
    assert stats["failed_steps"] == 1 and stats["failed_requests"] == 5
    assert sched.mem.cache_tokens() == 0  # nothing of the failed prefill was cached
    assert_settled(engine, sched)
    again = engine.generate(input_ids=prompts, sampling_params=_greedy())
    assert [o.token_ids for o in again] == ref and {o.finish_reason for o in again} == {"length"}
    assert_settled(engine, sched)


@pytest.mark.parametrize("flags", MODES[:2], ids=MODE_IDS[:2])
def test_a_failed_prefill_leaves_the_running_decodes_alone(engine, flags):
    prompts = _prompts(2, seed=2)
    ref = _reference(engine, prompts, n=20)
    sched = _fresh(engine, poisoned_prefill, **flags)
    running = [engine.make_request(p, _greedy(20)) for p in prompts]
    for r in running:
        sched.add(r)
    for _ in range(4):
        sched.step()
    poisoned = engine.make_request([POISON, 1, 2, 3], _greedy(20))
    sched.add(poisoned)
    outs = engine.run_until_done(running + [poisoned])
    assert [o.token_ids for o in outs[:2]] == ref
    assert outs[2].finish_reason == "error" and "injected failure" in outs[2].error
    assert sched.stats()["failed_requests"] == 1
    assert_settled(engine, sched)


@pytest.mark.parametrize("flags", MODES, ids=MODE_IDS)
def test_a_failed_decode_fails_its_batch_and_keeps_only_good_kv_cached(engine, flags):
    prompts = _prompts(3, seed=3)
    ref = _reference(engine, prompts)
    sched = _fresh(engine, NthDecode(3), **flags)
    out = engine.generate(input_ids=prompts, sampling_params=_greedy())
    assert [o.finish_reason for o in out] == ["error"] * 3
    for o, r in zip(out, ref):
        assert 1 <= len(o.token_ids) <= 3 and o.token_ids == r[:len(o.token_ids)]
    # The prompts were cached after their (good) prefill; the failed decode's KV was not.
    assert sched.mem.cache_tokens() == (sum(len(p) for p in prompts) if sched.cache else 0)
    assert_settled(engine, sched)
    # Continuations of prompt + the tokens emitted before the failure reuse whatever the failed scheduler
    # cached. Their reference comes from a second scheduler over the same pool (no cache: it leaves the
    # failed one's cached slots alone).
    nexts = [p + o.token_ids + [7, 8] for p, o in zip(prompts, out)]
    engine.scheduler = engine.make_scheduler(**BASELINE)
    next_ref = [o.token_ids for o in engine.generate(input_ids=nexts, sampling_params=_greedy())]
    engine.scheduler = sched
    hits = sched.stats()["prefix_cache_hit_tokens"]
    again = engine.generate(input_ids=prompts + nexts, sampling_params=_greedy())
    assert [o.token_ids for o in again] == ref + next_ref
    if sched.cache:
        assert sched.stats()["prefix_cache_hit_tokens"] - hits >= 2 * sum(len(p) - 1 for p in prompts)
    assert_settled(engine, sched)


def test_too_many_failed_steps_in_a_row_raise(engine):
    """A device that fails every step is not served forever: the error leaves the scheduler."""
    limit = scheduler_module.MAX_CONSECUTIVE_FAILED_STEPS
    sched = _fresh(engine, lambda fb: True, max_prefill_tokens=1, chunked_prefill_size=-1)
    reqs = [engine.make_request(p, _greedy()) for p in _prompts(limit + 1, seed=4)]
    for r in reqs:
        sched.add(r)
    for _ in range(limit - 1):  # one request admitted (and failed) per step
        sched.step()
    assert [r.finish_reason for r in reqs[:limit - 1]] == ["error"] * (limit - 1)
    with pytest.raises(RuntimeError, match="steps in a row failed"):
        sched.step()
    assert reqs[limit - 1].finish_reason == "error"  # the batch of the last step failed before the raise
    sched.abort_all()
    assert_settled(engine, sched)


class _Boom:
    """A tokenizer whose decode fails: the stop-string check of a request with stop strings raises."""

    def decode(self, ids, skip_special_tokens=True):
        raise ValueError("cannot decode")


def test_a_request_whose_output_processing_raises_fails_alone():
    proc = OutputProcessor(_Boom(), eos_ids=set(), max_model_len=64)
    plain = Request.new("plain", [1, 2], SamplingParams(max_new_tokens=4))
    stopped = Request.new("stop", [1, 2], SamplingParams(max_new_tokens=4, stop=["x"]))
    proc.process([plain, stopped], SampleResult(tokens=[5, 6], logprobs=[0.0, 0.0], top=[[], []]))
    assert plain.finish_reason is None and plain.output_ids == [5]
    assert stopped.finish_reason == "error"
    deltas = {d.rid: d for d in proc.take()}
    assert deltas["stop"].finish_reason == "error" and "cannot decode" in deltas["stop"].error
    assert deltas["plain"].new_token_ids == [5] and deltas["plain"].finish_reason is None
