"""Tree speculative sampling keeps the target distribution (chi-square on a 6-token vocabulary, fixed seed),
and the same test rejects an acceptance rule that forgets to renormalise the residual."""

import torch

from engine.sampling import SamplingParams
from engine.speculative.accept import accept_greedy, accept_sampled, children_of, target_probs

# A tree: root -> children carrying tokens 2, 0, 5 (the draft's top-3, in that order); the node of
# token 2 has children 1, 3. Node indices: 0 root, 1 (tok 2), 2 (tok 0), 3 (tok 5), 4 (tok 1), 5 (tok 3).
TOKENS = [4, 2, 0, 5, 1, 3]
PARENTS = [-1, 0, 0, 0, 1, 1]
P_ROOT = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.12, 0.18])
P_TWO = torch.tensor([0.02, 0.40, 0.08, 0.10, 0.30, 0.10])  # the target after token 2
DRAWS = 12000


def _probs(node: int) -> torch.Tensor:
    return P_TWO if node == 1 else torch.tensor([0.1, 0.3, 0.1, 0.2, 0.2, 0.1])


def _biased(probs_of, tokens, children, live, generator):
    """Wrong on purpose: accepts child x with p(x) even after earlier rejections (no renormalised residual)."""
    path, cur = [0], 0
    while True:
        p = probs_of(cur)
        r = p.clone()
        for c in children[cur]:
            if float(torch.rand((), generator=generator)) < float(p[tokens[c]]):
                path.append(c)
                cur = c
                break
            r[tokens[c]] = 0
        else:
            return path, int(torch.multinomial(r / r.sum(), 1, generator=generator)[0])


def _frequencies(accept, p_root):
    g = torch.Generator().manual_seed(1234)
    kids = children_of(PARENTS)
    live = [True] * len(TOKENS)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(DRAWS):
        path, bonus = accept(lambda j: p_root if j == 0 else _probs(j), TOKENS, kids, live, g)
        emitted = [TOKENS[j] for j in path[1:]] + [bonus]
        first[emitted[0]] += 1
        if emitted[0] == 2:
            second[emitted[1]] += 1
    return first, second


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_tree_sampling_preserves_target_distribution():
    first, second = _frequencies(accept_sampled, P_ROOT)
    assert _p_value(first, P_ROOT) > 1e-3
    assert second.sum() > 2000  # enough draws of the second level to test it
    assert _p_value(second, P_TWO) > 1e-3


def test_chi_square_rejects_biased_acceptance():
    first, second = _frequencies(_biased, P_ROOT)
    assert min(_p_value(first, P_ROOT), _p_value(second, P_TWO)) < 1e-6


def test_dead_children_are_never_accepted():
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(6)
    p[2] = 1.0  # the target is sure of token 2, but that node lies past the context limit
    live = [True, False, True, True, True, True]
    for _ in range(50):
        path, bonus = accept_sampled(lambda j: p, TOKENS, children_of(PARENTS), live, g)
        assert path == [0] and bonus == 2
    path, bonus = accept_greedy([2] * 6, TOKENS, children_of(PARENTS), live)
    assert path == [0] and bonus == 2


def test_greedy_walks_the_agreeing_path():
    argmax = [2, 3, 9, 9, 9, 7]  # root wants 2 (node 1), node 1 wants 3 (node 5), node 5 wants 7 (bonus)
    assert accept_greedy(argmax, TOKENS, children_of(PARENTS), [True] * 6) == ([0, 1, 5], 7)
    assert accept_greedy([1] + argmax[1:], TOKENS, children_of(PARENTS), [True] * 6) == ([0], 1)


def test_target_probs_truncate_and_renormalise():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0, 0.0])
    p = target_probs(logits, SamplingParams(temperature=0.7, top_k=3))
    assert torch.isclose(p.sum(), torch.tensor(1.0)) and int((p > 0).sum()) == 3
    assert p.argmax() == 4
