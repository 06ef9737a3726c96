"""Absorbed decode over the paged latent cache vs full prefill; batch invariance; retraction."""

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _prompts(n, seed=0, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def test_decode_logprobs_equal_full_prefill(engine):
    prompt = _prompts(1, seed=1)[0]
    gen = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=20, temperature=0, ignore_eos=True, logprobs=True))[0]
    full = prompt + gen.token_ids
    pre = engine.generate(input_ids=[full], sampling_params=SamplingParams(
        max_new_tokens=1, temperature=0, prompt_logprobs=True))[0]
    from_prefill = torch.tensor(pre.prompt_logprobs[len(prompt):])
    torch.testing.assert_close(torch.tensor(gen.logprobs), from_prefill, atol=1e-4, rtol=0)


def test_output_independent_of_batch_companions(engine):
    prompts = _prompts(6, seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    alone = [engine.generate(input_ids=[p], sampling_params=sp)[0] for p in prompts[:2]]
    together = engine.generate(input_ids=prompts, sampling_params=sp)
    for a, b in zip(alone, together[:2]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_retraction_keeps_outputs(engine):
    """A KV pool too small for every request at once forces retraction; outputs stay identical."""
    prompts = _prompts(4, seed=3, lo=20, hi=30)
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    ref = engine.generate(input_ids=prompts, sampling_params=sp)
    small = Engine(model="tiny", device="cpu", dtype="float32", max_total_tokens=110)
    got = small.generate(input_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    # Finished requests' KV stays in the radix prefix cache; evicting it frees the whole pool.
    assert small.runner.kv_pool.available() + small.scheduler.stats()["prefix_cache_tokens"] == 110
    small.scheduler.cache.evict_all()
    assert small.runner.kv_pool.available() == 110


def test_seeded_sampling_reproducible_and_seed_sensitive(engine):
    prompt = _prompts(1, seed=4)[0]
    def run(seed, companions=0):
        sp = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)]
        sp += [SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True) for _ in range(companions)]
        return engine.generate(input_ids=[prompt] * (1 + companions), sampling_params=sp)[0].token_ids
    assert run(5) == run(5) == run(5, companions=3)
    assert run(5) != run(6)


def test_stop_strings_and_token_ids(engine):
    prompt = _prompts(1, seed=5)[0]
    base = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]
    text = base.text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isprintable()), None)
    assert stop is not None, "the fixed prompt's continuation should contain printable text"
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert out.text == text[:text.find(stop)]
