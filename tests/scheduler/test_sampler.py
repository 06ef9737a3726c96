"""The device-side sampler agrees with a plain per-row host sampler: greedy tokens, log-probs and top
alternatives exactly; sampled tokens from the same support (their distributions are compared in
tests/test_sampling_batched.py: the batched sampler draws by inverse CDF, not with torch.multinomial)."""

import torch

from engine.sampling import SampleResult, SamplingParams, _truncate, sample_async


def sample(logits, params, generators) -> SampleResult:
    """Reference: one row at a time on the host (int() per token), the way sampling is usually written."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = []
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(int(logits[i].argmax()))
            continue
        probs = _truncate(torch.softmax(logits[i].float() / p.temperature, dim=-1), p)
        tokens.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    chosen = [float(logp[i, t]) for i, t in enumerate(tokens)]
    top = [list(zip(*(x.tolist() for x in reversed(logp[i].topk(p.top_logprobs))))) if p.top_logprobs else []
           for i, p in enumerate(params)]
    return SampleResult(tokens=tokens, logprobs=chosen, top=top)


def _params():
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.7, seed=2, top_logprobs=3),
        SamplingParams(temperature=1.3, min_p=0.05, seed=3, logprobs=True),
        SamplingParams(temperature=0, top_logprobs=5),
        SamplingParams(temperature=0.5),  # unseeded: the global generator
    ]


def _run(fn, logits):
    params = _params()
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    torch.manual_seed(123)
    return fn(logits, params, gens)


def test_same_tokens_logprobs_and_top_as_sample():
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(0)) * 3
    ref = _run(sample, logits)
    pending = _run(sample_async, logits.clone())
    assert pending.tokens.dtype == torch.int64 and pending.tokens.shape == (6,)
    got = pending.start_copy().resolve()
    params = _params()
    for i, p in enumerate(params):
        if p.greedy:
            assert got.tokens[i] == ref.tokens[i]
        else:
            assert _truncate(torch.softmax(logits[i] / p.temperature, dim=-1), p)[got.tokens[i]] > 0
    logp = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(torch.tensor(got.logprobs), logp[range(6), got.tokens])
    assert [[i for i, _ in t] for t in got.top] == [[i for i, _ in t] for t in ref.top]
    assert [len(t) for t in got.top] == [0, 0, 3, 0, 5, 0]


def test_greedy_rows_are_argmax():
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(1))
    got = sample_async(logits, [SamplingParams(temperature=0)] * 4, [None] * 4).resolve()
    assert got.tokens == logits.argmax(-1).tolist()
