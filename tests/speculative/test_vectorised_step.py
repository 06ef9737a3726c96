"""The spec step's tensor-op pieces against their per-node definitions, on random trees: every node's
ancestors (the verify KV lists), greedy acceptance of a whole batch at once (against `accept_greedy`,
with dead nodes and siblings that carry the same token), the tree table, the packed host-to-device copy;
and a batch mixing greedy and sampled requests."""

from __future__ import annotations

import random

import pytest
import torch

from engine.engine import Engine
from engine.forward_batch import columns_to_device
from engine.sampling import SamplingParams
from engine.speculative.accept import accept_greedy, accept_greedy_batch, children_of
from engine.speculative.step_batch import StepIndex
from engine.speculative.tree_table import ancestors, build_tree_table
from tests.speculative.helpers import FLAGS, SPEC, check_pool, prompts

CPU = torch.device("cpu")


def _random_tree(rnd: random.Random, n: int, steps: int) -> tuple[list[int], list[int]]:
    """parents (-1 at the root, parents first) and depths (<= steps) of an n-node tree."""
    parents, depths = [-1], [0]
    for _ in range(1, n):
        p = rnd.choice([i for i, d in enumerate(depths) if d < steps])
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents, depths


def _paths(parents: list[int]) -> list[list[int]]:
    """The definition: node indices from the root to each node."""
    paths: list[list[int]] = []
    for j, p in enumerate(parents):
        paths.append([0] if p < 0 else paths[p] + [j])
    return paths


def _batch(rnd: random.Random, b: int, n: int, steps: int, vocab: int):
    """b random trees with tokens from a small vocabulary (siblings may repeat a token), an argmax that often
    picks one of a node's children's tokens, and about one node in six dead."""
    parents, depths, tokens, argmax, live = [], [], [], [], []
    for _ in range(b):
        par, dep = _random_tree(rnd, n, steps)
        tok = [rnd.randrange(vocab) for _ in range(n)]
        kids = children_of(par)
        parents.append(par)
        depths.append(dep)
        tokens.append(tok)
        argmax.append([tok[rnd.choice(kids[j])] if kids[j] and rnd.random() < 0.8 else rnd.randrange(vocab)
                       for j in range(n)])
        live.append([rnd.random() > 1 / 6 for _ in range(n)])
    return [torch.tensor(x) for x in (parents, depths, tokens, argmax, live)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("steps,n", [(3, 8), (2, 4), (1, 5), (5, 16)])
def test_ancestors_are_the_paths_from_the_root(seed, steps, n):
    rnd = random.Random(seed)
    b = rnd.randint(1, 9)
    parents, depths, *_ = _batch(rnd, b, n, steps, 4)
    index = StepIndex.build(b, steps, 4, n, CPU)
    anc = ancestors(parents, depths, index.node_ids, index.levels)
    assert anc.shape == (b, n, steps + 1)
    for i in range(b):
        for j, path in enumerate(_paths(parents[i].tolist())):
            assert anc[i, j].tolist() == path + [j] * (steps + 1 - len(path))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("steps,n", [(3, 8), (2, 4), (4, 12), (1, 3)])
def test_greedy_batch_is_accept_greedy(seed, steps, n):
    rnd = random.Random(seed)
    b = rnd.randint(1, 12)
    parents, depths, tokens, argmax, live = _batch(rnd, b, n, steps, rnd.choice([2, 3, 50]))
    index = StepIndex.build(b, steps, 4, n, CPU)
    anc = ancestors(parents, depths, index.node_ids, index.levels)
    got = accept_greedy_batch(argmax, tokens, parents, depths, live.bool(), anc, index.earlier, index.is_root)
    for i, row in enumerate(got.tolist()):
        path, bonus = accept_greedy(argmax[i].tolist(), tokens[i].tolist(), children_of(parents[i].tolist()),
                                    live[i].bool().tolist())
        assert row == [len(path), bonus] + path + path[-1:] * (steps + 1 - len(path))


def test_tree_table_rows_on_random_lists():
    rnd = random.Random(0)
    req = torch.randint(1, 10_000, (6, 40), dtype=torch.int32)
    for depth in (1, 2, 4):
        r = rnd.randint(1, 10)
        rows = torch.tensor([rnd.randrange(6) for _ in range(r)])
        prefix = torch.tensor([rnd.randint(0, 36) for _ in range(r)])
        extra = torch.randint(1, 10_000, (r, depth))
        width = rnd.choice([int(prefix.max()), 40])  # a max_prefix beyond the table's width pads with zeros
        table = build_tree_table(req, rows, prefix, extra, width).table
        for i in range(r):
            p = int(prefix[i])
            assert table[i, :p + depth].tolist() == req[rows[i], :p].tolist() + extra[i].tolist()


def test_columns_to_device_is_one_concatenation():
    cols = columns_to_device([[1, 2], torch.tensor([[3, 4], [5, 6]]), [], list(range(100)), torch.empty(0),
                              torch.tensor([7], dtype=torch.int32)], CPU)
    assert [c.tolist() for c in cols] == [[1, 2], [3, 4, 5, 6], [], list(range(100)), [], [7]]
    assert all(c.dtype == torch.int64 for c in cols)
    assert len({c.untyped_storage().data_ptr() for c in cols}) == 1


def test_mixed_greedy_and_sampled_batch():
    """Greedy requests decode exactly as without speculation while sampled ones share their steps (their
    rows of the acceptance come from the host walk); sampled outputs repeat with their seeds (on a fresh
    engine: a warm radix cache may hold other draft KV, so other trees, which consume the seeded generator
    differently)."""
    off = Engine(model="tiny-py", **FLAGS)
    ps = prompts(off.config.vocab_size, n=9, seed=4)
    greedy = [i % 3 != 0 for i in range(len(ps))]
    params = [SamplingParams(max_new_tokens=11, temperature=0, ignore_eos=True, logprobs=True) if g else
              SamplingParams(max_new_tokens=11, temperature=0.9, top_k=20, seed=3 + i, ignore_eos=True)
              for i, g in enumerate(greedy)]
    ref = off.generate(input_ids=ps, sampling_params=params)
    on = Engine(model="tiny-py", **FLAGS, **SPEC)
    got = on.generate(input_ids=ps, sampling_params=params)
    again = Engine(model="tiny-py", **FLAGS, **SPEC).generate(input_ids=ps, sampling_params=params)
    for g, r, a, a2 in zip(greedy, ref, got, again):
        assert a.token_ids == a2.token_ids and len(a.token_ids) == 11
        if g:
            assert a.token_ids == r.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, r.logprobs)) < 1e-4
    assert on.scheduler.spec.stats.mean > 1.5
    check_pool(on)
