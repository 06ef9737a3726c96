"""Mixed batches (--enable-mixed-chunk) on the tiny model: running requests decode in the same forward as
a prefill chunk (one extend token each on their cached KV), within the step's token budget; greedy and
seeded outputs are identical with mixing on and off (overlap on and off, radix cache, small chunks, prompt
log-probs, KV exhaustion with retraction), and the KV pool is settled afterwards."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.forward_batch import ForwardMode
from engine.sampling import SamplingParams
from tests.scheduler.helpers import assert_settled, swap_scheduler

BASELINE = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True,
                enable_mixed_chunk=False)


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _rand(g, n):
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _prompts(seed=0):
    """Short and long prompts (up to 70 tokens), two shared system prompts, an exact repeat."""
    g = torch.Generator().manual_seed(seed)
    sys_a, sys_b = _rand(g, 30), _rand(g, 12)
    out = []
    for i in range(10):
        base = (sys_a, sys_b, [])[i % 3]
        out.append(base + _rand(g, int(torch.randint(1, 40, (1,), generator=g))))
    return out + [out[0], _rand(g, 3)]


def _params(n, new=10):
    """Greedy with log-probs, every third request seeded sampling; different lengths, so requests finish
    (and new ones start) at different steps."""
    return [SamplingParams(max_new_tokens=new + i % 5, temperature=0, ignore_eos=True, logprobs=True) if i % 3 else
            SamplingParams(max_new_tokens=new + i % 5, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)
            for i in range(n)]


def _same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        if x.logprobs is not None:
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def reference(engine):
    prompts = _prompts()
    swap_scheduler(engine, **BASELINE)
    return prompts, engine.generate(input_ids=prompts, sampling_params=_params(len(prompts)))


@pytest.mark.parametrize("flags", [
    dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    dict(chunked_prefill_size=16),
    dict(chunked_prefill_size=7, disable_radix_cache=True),
    dict(chunked_prefill_size=-1, max_prefill_tokens=20),
], ids=["chunk16", "chunk16-overlap", "chunk7-overlap-noradix", "nochunk-budget20-overlap"])
def test_mixed_outputs_identical_to_unmixed(engine, reference, flags):
    prompts, ref = reference
    params = _params(len(prompts))
    off = swap_scheduler(engine, enable_mixed_chunk=False, prefill_burst=False, **flags)
    got_off = engine.generate(input_ids=prompts, sampling_params=params)
    assert off.stats()["mixed_steps"] == 0
    assert_settled(engine, off)
    on = swap_scheduler(engine, enable_mixed_chunk=True, prefill_burst=False, **flags)
    got_on = engine.generate(input_ids=prompts, sampling_params=params)
    stats = on.stats()
    assert stats["mixed_steps"] > 0
    # decodes ride along with prefills: fewer forwards for the same work
    assert stats["extend_steps"] + stats["decode_steps"] < off.stats()["extend_steps"] + off.stats()["decode_steps"]
    assert_settled(engine, on)
    _same(got_off, ref)
    _same(got_on, ref)


def test_arrivals_while_decoding_identical(engine):
    """Requests arriving a few per step (prefills keep interleaving with decodes), overlap on and off."""
    prompts = _prompts(seed=4)
    params = _params(len(prompts), new=8)
    swap_scheduler(engine, **BASELINE)
    ref = engine.generate(input_ids=prompts, sampling_params=params)
    for overlap in (True, False):
        sched = swap_scheduler(engine, chunked_prefill_size=12, disable_overlap_schedule=not overlap, enable_mixed_chunk=True, prefill_burst=False)
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        queue = list(reqs)
        while queue or sched.has_work():
            for r in queue[:2]:
                sched.add(r)
            queue = queue[2:]
            sched.step()
        sched.flush()
        assert sched.stats()["mixed_steps"] > 0
        assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]
        assert_settled(engine, sched)


def test_decode_advances_in_the_same_forward_as_a_prefill_chunk(engine):
    """Step by step: while a long prompt is prefilled in chunks, every forward is one extend batch holding
    the next chunk and then one token of each running request (an extend of 1 at its next position), and
    the running requests gain a token every step; chunk plus decodes fit --chunked-prefill-size. With mixing
    off the same workload alternates chunk-only extend steps and decode steps."""
    g = torch.Generator().manual_seed(11)
    shorts, long = [_rand(g, 5), _rand(g, 7)], _rand(g, 90)
    chunk = 12
    for mixed in (True, False):
        sched = swap_scheduler(engine, chunked_prefill_size=chunk, disable_overlap_schedule=True, enable_mixed_chunk=mixed)
        runner, batches = engine.runner, []
        a = [engine.make_request(p, SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))
             for p in shorts]

        def spy(fb, forward=runner.forward, batches=batches, a=a):
            batches.append(dict(mode=fb.mode, ext=list(fb.extend_lens_cpu), pre=list(fb.prefix_lens_cpu),
                                rows=fb.req_pool_indices.tolist(), next_pos=[r.kv_len - 1 for r in a]))
            return forward(fb)

        runner.forward = spy
        try:
            for r in a:
                sched.add(r)
            sched.step()  # prefill both short prompts
            b = engine.make_request(long, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
            sched.add(b)
            batches.clear()
            gains = []
            while b.kv_len < len(long):
                before = [r.num_output for r in a]
                sched.step()
                gains.append([r.num_output - n for r, n in zip(a, before)])
        finally:
            del runner.forward
        extends = [x for x in batches if x["mode"] is ForwardMode.EXTEND]
        assert len(extends) >= len(long) // chunk
        if mixed:
            assert len(batches) == len(extends) == len(gains)  # no separate decode forward
            assert all(gain == [1, 1] for gain in gains)  # every step advanced both streams
            for x in extends:
                assert x["ext"][-2:] == [1, 1] and x["rows"][-2:] == [r.row for r in a]
                assert x["pre"][-2:] == x["next_pos"]  # each decode extends its own KV by its next token
                assert 0 < x["ext"][0] <= chunk - 2 and sum(x["ext"]) <= chunk  # the decodes count in the budget
            assert sched.stats()["mixed_steps"] == len(extends)
        else:
            modes = [x["mode"] for x in batches]
            assert all(m != n for m, n in zip(modes, modes[1:]))  # (decode,) extend, decode, extend, ...
            assert all(x["ext"] == [min(chunk, len(long) - x["pre"][0])] for x in extends)
            assert gains.count([0, 0]) == len(extends) and gains.count([1, 1]) == len(batches) - len(extends)
            assert sched.stats()["mixed_steps"] == 0
        engine.run_until_done(a + [b])
        assert_settled(engine, sched)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_kv_exhaustion_retracts_and_matches_a_large_pool(engine, overlap):
    """A pool far too small for the batch: mixed steps and retraction together; every request finishes with
    the output of a large pool."""
    g = torch.Generator().manual_seed(21)
    prompts = [_rand(g, int(torch.randint(8, 30, (1,), generator=g))) for _ in range(8)]
    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, logprobs=True) if i % 3 else
              SamplingParams(max_new_tokens=40, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)]
    swap_scheduler(engine, **BASELINE)
    ref = engine.generate(input_ids=prompts, sampling_params=params)
    small = Engine(model="tiny", device="cpu", dtype="float32", max_total_tokens=160)
    assert sum(len(p) + 40 for p in prompts) > 2 * 160
    sched = swap_scheduler(small, chunked_prefill_size=10, disable_overlap_schedule=not overlap, enable_mixed_chunk=True, prefill_burst=False)
    got = small.generate(input_ids=prompts, sampling_params=params)
    stats = sched.stats()
    assert stats["retracted_requests"] > 0 and stats["mixed_steps"] > 0
    _same(got, ref)
    assert_settled(small, sched)


def test_prompt_logprobs_in_mixed_steps(engine):
    g = torch.Generator().manual_seed(3)
    prompts = [_rand(g, n) for n in (6, 70, 33, 4, 50)]
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=True, logprobs=True)
    swap_scheduler(engine, **BASELINE)
    ref = engine.generate(input_ids=prompts, sampling_params=sp)
    sched = swap_scheduler(engine, chunked_prefill_size=9, max_prefill_tokens=9, enable_mixed_chunk=True, prefill_burst=False)
    got = engine.generate(input_ids=prompts, sampling_params=sp)
    assert sched.stats()["mixed_steps"] > 0
    _same(got, ref)
    for a, b in zip(got, ref):
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        torch.testing.assert_close(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]),
                                   atol=1e-4, rtol=0)
    assert_settled(engine, sched)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failed_mixed_step_fails_its_prefill_and_retries_its_decodes(engine, overlap):
    """A prefill that raises inside a mixed step fails its own request only: the decodes that rode along give
    back their KV slot, decode alone in the next step, and finish with the reference output."""
    from tests.scheduler.failing_runner import POISON, FailingRunner, poisoned_prefill, use_runner

    g = torch.Generator().manual_seed(5)
    prompts = [_rand(g, 9), _rand(g, 14)]
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    swap_scheduler(engine, **BASELINE)
    ref = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    failed_batches, after = [], []

    def when(fb):
        if failed_batches and len(after) < 1:
            after.append((fb.mode, list(fb.extend_lens_cpu)))
        bad = poisoned_prefill(fb)
        if bad:
            failed_batches.append(list(fb.extend_lens_cpu))
        return bad

    swap_scheduler(engine)
    sched = use_runner(engine, FailingRunner(engine.runner, when), enable_mixed_chunk=True, prefill_burst=False,
                       disable_overlap_schedule=not overlap)
    running = [engine.make_request(p, greedy) for p in prompts]
    for r in running:
        sched.add(r)
    for _ in range(4):
        sched.step()
    poisoned = engine.make_request([POISON, 1, 2, 3], greedy)
    sched.add(poisoned)
    outs = engine.run_until_done(running + [poisoned])
    assert failed_batches == [[4, 1, 1]]  # the poisoned prompt and both decodes in one mixed step
    assert after == [(ForwardMode.DECODE, [1, 1])]  # then the decodes alone
    assert [o.token_ids for o in outs[:2]] == ref and [o.finish_reason for o in outs[:2]] == ["length"] * 2
    assert outs[2].finish_reason == "error" and "injected failure" in outs[2].error
    assert sched.stats()["failed_requests"] == 1 and sched.stats()["failed_steps"] == 1
    assert_settled(engine, sched)
