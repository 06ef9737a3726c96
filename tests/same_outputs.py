"""What the tests that compare a path against a reference engine (graphs, TP ranks, speculation, fused kernels)
share: greedy runs with log-probs on random prompts, and the check that two runs hold the same tokens and how far
apart their log-probs are."""

import torch

from engine.sampling import SamplingParams


def greedy_outputs(eng, lengths, seed: int, max_new_tokens: int = 8):
    """`eng`'s greedy outputs, with log-probs, for random prompts of `lengths` tokens (ids below 256, drawn from
    `seed`)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, logprobs=True)
    return eng.generate(input_ids=prompts, sampling_params=sp)


def logprob_gap(got, ref) -> float:
    """Asserts that `got` and `ref` (outputs with log-probs, request by request) hold the same tokens; returns
    the largest log-prob difference at any position."""
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    return max(abs(a - b) for o, r in zip(got, ref) for a, b in zip(o.logprobs, r.logprobs))
