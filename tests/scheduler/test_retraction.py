"""KV exhaustion on the tiny model: a small KV pool makes decode run out of slots, the newest requests are
retracted (their KV freed or cached, requeued at the front, resumed by recompute), and every request still
finishes with the output a large pool gives, greedy and seeded alike; admission keeps a reservation for
the tokens admitted requests will still generate, and a lone request is always admitted."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import admission
from engine.scheduler.admission import Reservation
from engine.scheduler.request import Request
from tests.scheduler.helpers import assert_settled, swap_scheduler

SMALL_POOL = 200


@pytest.fixture(scope="module")
def large():
    return Engine(model="tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def small():
    return Engine(model="tiny", device="cpu", dtype="float32", max_total_tokens=SMALL_POOL)


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(8, 21, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _params(n):
    """Greedy with log-probs, and every third request seeded sampling; all run to max_new_tokens."""
    return [SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True, logprobs=True) if i % 3 else
            SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(large):
    prompts = _prompts()
    swap_scheduler(large, disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True)
    return prompts, large.generate(input_ids=prompts, sampling_params=_params(len(prompts)))


@pytest.mark.parametrize("flags", [
    dict(),  # radix cache, chunked prefill, overlap
    dict(disable_overlap_schedule=True),
    dict(disable_radix_cache=True),
    dict(chunked_prefill_size=8),
], ids=["defaults", "no-overlap", "no-radix", "chunk8"])
def test_small_pool_retracts_and_every_request_matches_a_large_pool(small, reference, flags):
    prompts, ref = reference
    assert sum(len(p) + 48 for p in prompts) > 2 * SMALL_POOL  # they cannot all run at once
    sched = swap_scheduler(small, **flags)
    got = small.generate(input_ids=prompts, sampling_params=_params(len(prompts)))
    assert sched.stats()["retracted_requests"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == ["length"] * len(prompts)
    for a, b in zip(got, ref):
        if a.logprobs is not None:
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert_settled(small, sched)


def test_a_prompt_as_large_as_the_pool_is_served_alone(small):
    """Admitted with nothing else running (no reservation), it gets the token of its prefill and ends with
    'length' when there is no slot for a second one, instead of waiting forever."""
    sched = swap_scheduler(small)
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 256, (SMALL_POOL,), generator=g).tolist()
    out = small.generate(input_ids=[big], sampling_params=SamplingParams(max_new_tokens=5, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert_settled(small, sched)


def _req(prompt_len: int, max_new: int, generated: int = 0) -> Request:
    req = Request.new("r", list(range(prompt_len)), SamplingParams(max_new_tokens=max_new))
    req.token_ids += [1] * generated
    return req


def test_reservation_decays_with_decode_steps_and_rises_after_a_retraction():
    res = Reservation(max_model_len=10_000)
    req = _req(10, 100, generated=20)
    assert res.future(req) == int(80 * admission.INIT_RATIO)
    assert res.future(_req(10, 10**6)) == int(admission.CLIP_NEW_TOKENS * admission.INIT_RATIO)
    assert res.future(_req(9990, 10**6)) == int(10 * admission.INIT_RATIO)  # bounded by the context
    for _ in range(10**4):
        res.decode_step()
    assert res.ratio == admission.MIN_RATIO
    res.retracted()
    assert res.ratio == pytest.approx(admission.INIT_RATIO + admission.RETRACT_STEP)
    for _ in range(20):
        res.retracted()
    assert res.ratio == 1.0 and res.future(req) == 80
