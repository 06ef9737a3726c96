"""Scheduler invariants on the tiny model: greedy (and seeded) outputs are identical to the baseline
scheduler (no radix cache, no chunking, no overlap) with the radix cache on, chunked prefill, lpm,
overlap, big vs small batches and under KV pressure; KV accounting is exact afterwards."""

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.scheduler.helpers import assert_settled, swap_scheduler

BASELINE = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _rand(g, n):
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _prompts(seed=0, n_shared=6, n_random=4):
    """Prompts sharing prefixes (two system prompts), exact repeats, and unrelated ones."""
    g = torch.Generator().manual_seed(seed)
    sys_a, sys_b = _rand(g, 24), _rand(g, 9)
    out = []
    for i in range(n_shared):
        base = sys_a if i % 2 == 0 else sys_b
        out.append(base + _rand(g, int(torch.randint(1, 20, (1,), generator=g))))
    out += [out[0], out[1], sys_a]
    out += [_rand(g, int(torch.randint(2, 40, (1,), generator=g))) for _ in range(n_random)]
    return out


def _check_pool(engine, sched, evict=True):
    """Every slot is free or held by the cache, exactly once; evicting the cache frees everything."""
    sched.flush()
    assert not sched.has_work()
    pool = engine.runner.kv_pool
    free = pool.free_slots()
    assert free.unique().numel() == free.numel(), "a slot was freed twice"
    held = sched.cache.all_slots() if sched.cache else torch.empty(0, dtype=torch.int64)
    assert pool.available() + sched.mem.cache_tokens() == pool.size
    assert torch.cat((free, held)).sort().values.tolist() == list(range(1, pool.size + 1))
    if sched.cache:
        assert sched.cache.protected_size() == 0
        if evict:
            sched.cache.evict_all()
            assert pool.available() == pool.size and sched.cache.total_size() == 0
    assert engine.runner.req_to_token.available() == engine.args.scheduler.max_running_requests


def _gen(engine, prompts, sp, check=True, **opts):
    sched = swap_scheduler(engine, **opts)
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    if check:
        _check_pool(engine, sched)
    return outs, sched


def _greedy(n=12, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True, **kw)


def _same(a, b, atol=1e-4):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        if x.logprobs is not None:
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def baseline(engine):
    prompts = _prompts()
    return prompts, _gen(engine, prompts, _greedy(), **BASELINE)[0]


@pytest.mark.parametrize("opts", [
    dict(chunked_prefill_size=-1, disable_overlap_schedule=True),
    dict(chunked_prefill_size=16, disable_overlap_schedule=True),
    dict(disable_radix_cache=True, chunked_prefill_size=16, disable_overlap_schedule=False),
    dict(chunked_prefill_size=16, disable_overlap_schedule=False, max_prefill_tokens=8),
    dict(schedule_policy="lpm"),
    dict(),  # the defaults: radix on, chunks of 8192, overlap on
], ids=["radix", "radix-chunk16", "chunk16-overlap", "all-budget8", "lpm", "defaults"])
def test_outputs_identical_to_baseline(engine, baseline, opts):
    prompts, ref = baseline
    got, _ = _gen(engine, prompts, _greedy(), **opts)
    _same(got, ref)


def test_radix_cache_hits_on_repeats_and_outputs_unchanged(engine, baseline):
    prompts, ref = baseline
    sched = swap_scheduler(engine)
    first = engine.generate(input_ids=prompts, sampling_params=_greedy())
    hits_first = sched.stats()["prefix_cache_hit_tokens"]
    second = engine.generate(input_ids=prompts, sampling_params=_greedy())
    stats = sched.stats()
    _same(first, ref)
    _same(second, ref)
    # Second pass: every prompt but its last token is cached.
    assert stats["prefix_cache_hit_tokens"] - hits_first == sum(len(p) - 1 for p in prompts)
    assert 0 < stats["prefix_cache_hit_rate"] < 1 and stats["prefix_cache_tokens"] > 0
    _check_pool(engine, sched)


def test_shared_prefix_hits_across_admission_steps(engine):
    """Requests admitted one per step reuse the shared prefix prefilled by the first one."""
    prompts = _prompts(seed=5)[:6]
    ref, _ = _gen(engine, prompts, _greedy(6), **BASELINE)
    got, sched = _gen(engine, prompts, _greedy(6), check=False, max_prefill_tokens=1,
                       chunked_prefill_size=-1)
    _same(got, ref)
    assert sched.stats()["prefix_cache_hit_tokens"] > 0
    _check_pool(engine, sched)


def test_multi_turn_reuses_prompt_and_output(engine):
    g = torch.Generator().manual_seed(7)
    turn1 = _rand(g, 30)
    for overlap in (False, True):
        sched = swap_scheduler(engine, disable_overlap_schedule=not overlap)
        out1 = engine.generate(input_ids=[turn1], sampling_params=_greedy(10))[0]
        turn2 = turn1 + out1.token_ids + _rand(g, 5)
        req = engine.make_request(turn2, _greedy(5))
        sched.add(req)
        engine.run_until_done([req])
        assert req.cached_tokens >= len(turn1) + len(out1.token_ids) - 1
        ref = _gen(engine, [turn2], _greedy(5), **BASELINE)[0][0]
        assert req.output_ids == ref.token_ids


def test_chunked_prefill_prompt_logprobs_and_long_prompts(engine):
    g = torch.Generator().manual_seed(3)
    prompts = [_rand(g, n) for n in (70, 5, 33, 17, 1)]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=True, logprobs=True)
    ref, _ = _gen(engine, prompts, sp, **BASELINE)
    for opts in (dict(chunked_prefill_size=16, disable_overlap_schedule=True), dict(chunked_prefill_size=7),
                 dict(chunked_prefill_size=16, max_prefill_tokens=3)):
        got, sched = _gen(engine, prompts, sp, **opts)
        _same(got, ref)
        for a, b in zip(got, ref):
            assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
            torch.testing.assert_close(torch.tensor(a.prompt_logprobs[1:]), torch.tensor(b.prompt_logprobs[1:]),
                                       atol=1e-4, rtol=0)


def test_decodes_continue_between_chunks(engine):
    """A long prompt arriving while others decode is prefilled in chunks, with decode steps in between."""
    g = torch.Generator().manual_seed(11)
    short, long = _rand(g, 5), _rand(g, 90)
    sched = swap_scheduler(engine, chunked_prefill_size=10, disable_overlap_schedule=True)
    a = engine.make_request(short, _greedy(30))
    sched.add(a)
    sched.step()  # prefill a
    b = engine.make_request(long, _greedy(4))
    sched.add(b)
    grew = []
    while b.kv_len < len(long) and sched.has_work():
        before = len(a.output_ids)
        sched.step()
        grew.append(len(a.output_ids) - before)
    assert sum(grew) >= 8  # ~one decode per chunk of the 9 chunks
    engine.run_until_done([a, b])
    ref, _ = _gen(engine, [short, long], [_greedy(30), _greedy(4)], **BASELINE)
    assert [a.output_ids, b.output_ids] == [o.token_ids for o in ref]


def test_lpm_orders_by_cached_prefix(engine):
    g = torch.Generator().manual_seed(13)
    warm = _rand(g, 40)
    sched = swap_scheduler(engine, schedule_policy="lpm", disable_overlap_schedule=True, max_prefill_tokens=1,
                 chunked_prefill_size=-1)
    engine.generate(input_ids=[warm], sampling_params=_greedy(2))
    cold = [_rand(g, 10) for _ in range(3)]
    hot = warm[:30] + _rand(g, 3)
    reqs = [engine.make_request(p, _greedy(3)) for p in cold + [hot]]
    for r in reqs:
        sched.add(r)
    sched.step()  # admits one request: the one with the longest cached prefix
    assert reqs[-1].admitted == 1 and all(r.admitted == 0 for r in reqs[:-1])
    engine.run_until_done(reqs)
    ref, _ = _gen(engine, cold + [hot], _greedy(3), **BASELINE)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]


def test_overlap_with_stops_and_seeded_sampling(engine):
    prompts = _prompts(seed=2)
    probe, _ = _gen(engine, prompts[:4], _greedy(16), **BASELINE)
    params = [
        SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[probe[0].token_ids[5]]),
        SamplingParams(max_new_tokens=16, temperature=0, stop=[probe[1].text[3:6]] if len(probe[1].text) > 6 else []),
        SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
    ] + [SamplingParams(max_new_tokens=int(4 + i), temperature=0.9, top_p=0.9, seed=i, ignore_eos=True, logprobs=True)
         for i in range(len(prompts) - 4)]
    ref, _ = _gen(engine, prompts, params, **BASELINE)
    for overlap in (True, False):
        got, _ = _gen(engine, prompts, params, disable_overlap_schedule=not overlap, chunked_prefill_size=8)
        _same(got, ref)
        assert [o.text for o in got] == [o.text for o in ref]
        assert [o.matched_stop for o in got] == [o.matched_stop for o in ref]
    assert ref[0].finish_reason == "stop" and len(ref[0].token_ids) <= 6


def test_batch_of_one_equals_batch_of_32(engine):
    g = torch.Generator().manual_seed(17)
    prompts = [_rand(g, int(torch.randint(3, 30, (1,), generator=g))) for _ in range(32)]
    together, _ = _gen(engine, prompts, _greedy(8))
    sched = swap_scheduler(engine, **BASELINE)
    alone = [engine.generate(input_ids=[p], sampling_params=_greedy(8))[0] for p in prompts]
    _check_pool(engine, sched)
    _same(together, alone)


def test_kv_pressure_evicts_and_retracts_without_dropping(engine, baseline):
    prompts, ref = baseline
    small = Engine(model="tiny", device="cpu", dtype="float32", max_total_tokens=64)  # the longest prompt + 12 fit
    for opts in (dict(disable_overlap_schedule=True), dict(chunked_prefill_size=8), dict(disable_radix_cache=True)):
        sched = swap_scheduler(small, **opts)
        first = small.generate(input_ids=prompts, sampling_params=_greedy())
        got = small.generate(input_ids=prompts, sampling_params=_greedy())  # with a full cache
        stats = sched.stats()
        _same(first, ref)
        _same(got, ref)
        assert stats["retracted_requests"] > 0
        if sched.cache:
            assert stats["prefix_cache_evicted_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        _check_pool(small, sched)


def test_abort_mid_decode_and_mid_chunked_prefill(engine):
    g = torch.Generator().manual_seed(19)
    prompts = [_rand(g, 8), _rand(g, 60), _rand(g, 12)]
    ref, _ = _gen(engine, prompts, _greedy(10), **BASELINE)
    for overlap in (True, False):
        sched = swap_scheduler(engine, chunked_prefill_size=10, disable_overlap_schedule=not overlap)
        reqs = [engine.make_request(p, _greedy(10)) for p in prompts]
        for r in reqs:
            sched.add(r)
        for _ in range(3):
            sched.step()
        assert sched.prefilling is reqs[1]
        sched.abort(reqs[1].rid)  # mid chunked prefill
        sched.step()
        sched.abort(reqs[0].rid)  # mid decode
        engine.run_until_done(reqs)
        assert reqs[0].finish_reason == reqs[1].finish_reason == "abort"
        assert reqs[0].output_ids == ref[0].token_ids[:len(reqs[0].output_ids)]
        assert reqs[2].output_ids == ref[2].token_ids
        _check_pool(engine, sched)


def test_stats_keys(engine):
    sched = swap_scheduler(engine)
    stats = sched.stats()
    for key in ("prefix_cache_tokens", "prefix_cache_hit_rate", "prefix_cache_hit_tokens", "prompt_tokens"):
        assert key in stats
    assert swap_scheduler(engine, disable_radix_cache=True).stats()["prefix_cache_tokens"] == 0


def test_flush_cache_only_when_idle(engine):
    sched = swap_scheduler(engine)
    req = engine.make_request(list(range(1, 30)), _greedy(5))
    sched.add(req)
    sched.step()
    assert sched.flush_cache() == -1  # a request is running
    engine.run_until_done([req])
    held = sched.stats()["prefix_cache_tokens"]
    assert held >= 29 and sched.flush_cache() == held
    assert engine.runner.kv_pool.available() == engine.runner.kv_pool.size


@pytest.mark.parametrize("overlap", [True, False])
def test_a_finished_requests_last_output_is_taken_before_its_release(engine, overlap):
    """The step that finishes requests hands out their last outputs while they still hold their KV; the next
    step releases them (radix-cache insert, slots freed) before it schedules, and nothing leaks."""
    sched = swap_scheduler(engine, disable_overlap_schedule=not overlap)
    reqs = [engine.make_request(list(range(1, 20 + i)), _greedy(4)) for i in range(3)]
    for req in reqs:
        sched.add(req)
    finished = {}
    while len(finished) < len(reqs):
        sched.step()
        for out in sched.take_outputs():
            if out.finished:
                finished[out.rid] = next(r for r in reqs if r.rid == out.rid)
    held = [r for r in finished.values() if r.row is not None]
    assert held, "the step that finished them released them before their outputs were taken"
    assert sched.has_work()  # the release is the next step's work
    sched.step()
    assert all(r.row is None for r in reqs)
    assert_settled(engine, sched)
