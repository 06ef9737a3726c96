"""Greedy outputs are identical with speculative decoding on and off (tiny and tiny-fp8, 32 prompts,
batched and batch 1, radix cache with shared prefixes, chunked prefill, overlap on), with the random MTP
layer and with an oracle draft that gets long runs accepted; stops and max_tokens inside an accepted run;
retraction under KV pressure; KV accounting exact afterwards."""

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.same_outputs import logprob_gap
from tests.speculative.helpers import FLAGS, SPEC, check_pool, oracle_draft, prompts

MAX_NEW = 6
SMALL_TREE = dict(SPEC, speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4)


def _engines(model):
    off = Engine(model=model, **FLAGS)
    on = Engine(model=model, **FLAGS, **SPEC)
    ps = prompts(off.config.vocab_size)
    ref = off.generate(input_ids=ps, sampling_params=_greedy())
    return off, on, ps, ref


@pytest.fixture(scope="module")
def engines():
    return _engines("tiny")


def test_batched_identical_fp8():
    """tiny-fp8 (block-FP8 checkpoint, dequantised on CPU): the batched case only, to keep CI short."""
    off, on, ps, ref = _engines("tiny-fp8")
    assert _ids(on.generate(input_ids=ps, sampling_params=_greedy())) == _ids(ref)
    check_pool(on)


def _greedy(n=MAX_NEW, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def _ids(outs):
    return [o.token_ids for o in outs]


def test_batched_identical(engines):
    off, on, ps, ref = engines
    got = on.generate(input_ids=ps, sampling_params=_greedy())
    assert _ids(got) == _ids(ref)
    assert len({t for o in ref for t in o.token_ids}) > 16, "degenerate outputs: a weak comparison"
    st = on.scheduler.stats()
    assert st["spec_accept_hist"][0] > 0 and st["decode_steps"] > 0
    check_pool(on)


def test_batch_one_identical(engines):
    off, on, ps, ref = engines
    old = on.scheduler
    old.flush()
    old.cache.evict_all()  # the two schedulers share the pool: start from an empty cache
    on.scheduler = on.make_scheduler(max_running_requests=1)
    try:
        got = on.generate(input_ids=ps, sampling_params=_greedy(4))
        assert _ids(got) == [o.token_ids[:4] for o in ref]
        check_pool(on)
    finally:
        on.scheduler.cache.evict_all()
        on.scheduler = old


def test_oracle_draft_long_runs_identical(engines, monkeypatch):
    """Most draft tokens accepted: accepted KV placed right, rejected KV freed, radix cache sees accepted only."""
    off, on, ps, _ = engines
    n = 12
    ref = off.generate(input_ids=ps, sampling_params=_greedy(n, logprobs=True))
    refs = {tuple(p): o.token_ids for p, o in zip(ps, ref)}
    before = list(on.scheduler.spec.stats.hist)
    with oracle_draft(monkeypatch, on, refs) as calls:
        got = on.generate(input_ids=ps, sampling_params=_greedy(n, logprobs=True))
    assert calls[0] > 0
    assert logprob_gap(got, ref) < 1e-4
    hist = [a - b for a, b in zip(on.scheduler.spec.stats.hist, before)]
    assert hist[-1] > 0 and hist[1] > 0, hist  # full runs and rejections at depth 2 both happened
    check_pool(on)
    # a second pass reuses the cached prompts + outputs: the cache held only accepted (correct) tokens
    again = on.generate(input_ids=ps, sampling_params=_greedy(n))
    assert _ids(again) == _ids(ref)
    check_pool(on)


def test_stops_inside_accepted_runs(engines, monkeypatch):
    """EOS-like stop ids, stop strings and max_tokens that land mid-run end the output where plain decode does."""
    off, on, ps, _ = engines
    ps = ps[:12]
    long = off.generate(input_ids=ps, sampling_params=_greedy(10))
    refs = {tuple(p): o.token_ids for p, o in zip(ps, long)}
    params = []
    for i, o in enumerate(long):
        if i % 3 == 0:
            params.append(_greedy(10, stop_token_ids=[o.token_ids[2 + i % 4]]))
        elif i % 3 == 1:
            params.append(_greedy(2 + i % 5))
        else:
            text = off.tokenizer.decode(o.token_ids[:6]) if off.tokenizer else ""
            params.append(_greedy(10, stop=[text[-2:]] if len(text) >= 2 else []))
    want = off.generate(input_ids=ps, sampling_params=params)
    with oracle_draft(monkeypatch, on, refs, corrupt_every=1000):
        got = on.generate(input_ids=ps, sampling_params=params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason, g.matched_stop, g.text) == (w.token_ids, w.finish_reason,
                                                                          w.matched_stop, w.text)
    assert any(len(w.token_ids) < 10 for w in want)
    check_pool(on)


def test_retraction_under_kv_pressure():
    """A pool too small for every request's draft + verify slots: retraction, and still identical output."""
    flags = dict(FLAGS, max_total_tokens=240)
    off = Engine(model="tiny", **flags)
    on = Engine(model="tiny", **flags, **SPEC)
    ps = prompts(off.config.vocab_size, n=10, seed=9)
    params = _greedy(12)
    assert _ids(on.generate(input_ids=ps, sampling_params=params)) == \
        _ids(off.generate(input_ids=ps, sampling_params=params))
    assert on.scheduler.stats()["retracted_requests"] > 0
    check_pool(on)


def test_sampled_requests_run_and_are_seeded():
    eng = Engine(model="tiny", **FLAGS, **SPEC)
    ps = prompts(eng.config.vocab_size, n=6)
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=7 + i, ignore_eos=True,
                             logprobs=True, top_logprobs=2) for i in range(len(ps))]
    a = eng.generate(input_ids=ps, sampling_params=params)
    b = eng.generate(input_ids=ps, sampling_params=params)
    assert _ids(a) == _ids(b) and all(len(o.token_ids) == 8 for o in a)
    assert all(len(o.logprobs) == 8 and len(o.top_logprobs[0]) == 2 for o in a)
    assert all(all(lp <= 0 for lp in o.logprobs) for o in a)
    check_pool(eng)


def test_no_overlap_and_no_radix_cache_identical():
    flags = dict(FLAGS, disable_overlap_schedule=True, disable_radix_cache=True, chunked_prefill_size=-1)
    off = Engine(model="tiny", **flags)
    on = Engine(model="tiny", **flags, **SMALL_TREE)
    ps = prompts(off.config.vocab_size, n=8, seed=4)
    assert _ids(on.generate(input_ids=ps, sampling_params=_greedy())) == \
        _ids(off.generate(input_ids=ps, sampling_params=_greedy()))
    check_pool(on)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter case is for CPU runs")
def test_triton_backend_interpreted_identical():
    flags = dict(FLAGS, attention_backend="triton")
    off = Engine(model="tiny", **flags)
    on = Engine(model="tiny", **flags, **SMALL_TREE)
    ps = prompts(off.config.vocab_size, n=3, seed=5)
    assert _ids(on.generate(input_ids=ps, sampling_params=_greedy(3))) == \
        _ids(off.generate(input_ids=ps, sampling_params=_greedy(3)))


def test_context_limit_inside_an_accepted_run(monkeypatch):
    """Nodes past --max-model-len are never accepted; the output ends at the limit exactly as plain decode."""
    flags = dict(FLAGS, max_model_len=24)
    off = Engine(model="tiny", **flags)
    on = Engine(model="tiny", **flags, **SPEC)
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(3, 256, (12 + 2 * i,), generator=g).tolist() for i in range(5)]  # 12 .. 20 tokens
    params = _greedy(30)
    ref = off.generate(input_ids=ps, sampling_params=params)
    with oracle_draft(monkeypatch, on, {tuple(p): o.token_ids for p, o in zip(ps, ref)}, corrupt_every=1000):
        got = on.generate(input_ids=ps, sampling_params=params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in ref]
    assert all(len(p) + len(o.token_ids) == 24 for p, o in zip(ps, got))
    check_pool(on)
