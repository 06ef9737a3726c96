"""One check shared by the tests that compare a path against a reference engine (graphs, TP ranks,
speculation): the same tokens, and how far apart their log-probs are."""


def logprob_gap(got, ref) -> float:
    """Asserts that `got` and `ref` (outputs with log-probs, request by request) hold the same tokens; returns
    the largest log-prob difference at any position."""
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    return max(abs(a - b) for o, r in zip(got, ref) for a, b in zip(o.logprobs, r.logprobs))
