"""Radix prefix cache: match / insert / split, locking, LRU eviction, and a random-operation
property test against a plain dict model (prefix tuple -> slot)."""

import random

import pytest
import torch

from engine.memory.radix_cache import RadixCache


class Freed:
    def __init__(self):
        self.slots: list[int] = []

    def __call__(self, slots: torch.Tensor) -> None:
        self.slots += slots.tolist()


def _slots(a, b):
    return torch.arange(a, b, dtype=torch.int64)


@pytest.fixture
def cache():
    freed = Freed()
    c = RadixCache(freed)
    c.freed = freed
    return c


def test_insert_then_match(cache):
    assert cache.insert([1, 2, 3, 4], _slots(10, 14)) == 0
    slots, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert slots.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix([9, 1])[0].numel() == 0
    assert cache.match_prefix([1, 2, 3, 4], limit=2)[0].tolist() == [10, 11]
    assert cache.total_size() == cache.evictable_size() == 4


def test_match_inside_node_splits_it(cache):
    cache.insert([1, 2, 3, 4], _slots(10, 14))
    slots, node = cache.match_prefix([1, 2, 7])
    assert slots.tolist() == [10, 11]
    assert node.key == [1, 2] and len(node.children) == 1
    (tail,) = node.children.values()
    assert tail.key == [3, 4] and tail.slots.tolist() == [12, 13]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    assert cache.total_size() == 4


def test_insert_reports_already_cached_prefix_and_branches(cache):
    cache.insert([1, 2, 3, 4], _slots(10, 14))
    assert cache.insert([1, 2, 5, 6, 7], _slots(20, 25)) == 2  # [1, 2] already there
    assert cache.match_prefix([1, 2, 5, 6, 7])[0].tolist() == [10, 11, 22, 23, 24]
    assert cache.insert([1, 2, 3, 4], _slots(30, 34)) == 4  # the tree keeps its own slots
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    assert cache.total_size() == 7
    assert cache.match_length([1, 2, 5, 9]) == 3 and cache.match_length([4]) == 0


def test_insert_rejects_length_mismatch(cache):
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], _slots(0, 2))


def test_locked_path_is_never_evicted(cache):
    cache.insert([1, 2, 3, 4], _slots(10, 14))
    cache.insert([1, 2, 5], _slots(20, 23))
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1  # only [5] is unlocked
    assert cache.evict(100) == 1
    assert sorted(cache.freed.slots) == [22]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    cache.dec_lock(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    assert cache.evict_all() == 4
    assert sorted(cache.freed.slots) == [10, 11, 12, 13, 22] and cache.total_size() == 0


def test_lock_counts_are_reference_counts(cache):
    cache.insert([1, 2, 3], _slots(0, 3))
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock(node)
    cache.inc_lock(node)
    cache.dec_lock(node)
    assert cache.evict_all() == 0  # still held once
    cache.dec_lock(node)
    assert cache.evict_all() == 3
    with pytest.raises(RuntimeError):
        cache.dec_lock(node)


def test_split_keeps_locks(cache):
    cache.insert([1, 2, 3, 4], _slots(0, 4))
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)
    cache.match_prefix([1, 2])  # splits the locked node
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert cache.evict_all() == 0
    cache.dec_lock(node)
    assert cache.evictable_size() == 4


def test_eviction_is_least_recently_used_first(cache):
    cache.insert([1, 1], _slots(0, 2))
    cache.insert([2, 2], _slots(2, 4))
    cache.insert([3, 3], _slots(4, 6))
    cache.match_prefix([1, 1])  # touch [1, 1]: now [2, 2] is the oldest
    assert cache.evict(1) == 2
    assert sorted(cache.freed.slots) == [2, 3]
    assert cache.evict(1) == 2
    assert sorted(cache.freed.slots) == [2, 3, 4, 5]
    assert cache.match_prefix([1, 1])[0].tolist() == [0, 1]


def test_eviction_goes_leaf_first_then_parent(cache):
    cache.insert([1, 2, 3], _slots(0, 3))
    cache.insert([1, 2, 4], _slots(10, 13))  # splits: [1, 2] -> {[3], [4]}
    cache.match_prefix([1, 2, 4])
    assert cache.evict(1) == 1 and cache.freed.slots == [2]  # leaf [3] (older) before its parent
    assert cache.evict(1) == 1 and cache.freed.slots == [2, 12]
    assert cache.evict(1) == 2 and sorted(cache.freed.slots) == [0, 1, 2, 12]  # the parent, now a leaf
    assert cache.total_size() == 0


def test_random_operations_match_a_dict_model():
    """Random insert / match / lock / unlock / evict against {prefix tuple: slot}."""
    rng = random.Random(0)
    for _trial in range(20):
        freed = Freed()
        cache = RadixCache(freed)
        model: dict[tuple, int] = {}
        locks: list[tuple[object, tuple]] = []  # (node, matched ids)
        next_slot = 0
        for _ in range(150):
            op = rng.random()
            ids = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            if op < 0.4:
                slots = _slots(next_slot, next_slot + len(ids))
                next_slot += len(ids)
                present = cache.insert(ids, slots)
                expect = 0
                while expect < len(ids) and tuple(ids[:expect + 1]) in model:
                    expect += 1
                assert present == expect
                for i in range(present, len(ids)):
                    model[tuple(ids[:i + 1])] = int(slots[i])
            elif op < 0.65:
                got, node = cache.match_prefix(ids)
                expect = []
                while len(expect) < len(ids) and tuple(ids[:len(expect) + 1]) in model:
                    expect.append(model[tuple(ids[:len(expect) + 1])])
                assert got.tolist() == expect
                if rng.random() < 0.5 and expect:
                    cache.inc_lock(node)
                    locks.append((node, tuple(ids[:len(expect)])))
            elif op < 0.8 and locks:
                node, _ = locks.pop(rng.randrange(len(locks)))
                cache.dec_lock(node)
            else:
                before = len(freed.slots)
                n = rng.randint(1, 10)
                evictable = cache.evictable_size()
                got = cache.evict(n)
                new = set(freed.slots[before:])
                assert got == len(new) >= min(n, evictable)
                locked = {p[:i] for _, p in locks for i in range(1, len(p) + 1)}
                for key in [k for k, v in model.items() if v in new]:
                    assert key not in locked, "a locked prefix was evicted"
                    del model[key]
                assert all(k[:-1] in model for k in model if len(k) > 1), "eviction left a hole"
            locked = {p[:i] for _, p in locks for i in range(1, len(p) + 1)}
            assert cache.total_size() == len(model)
            assert cache.protected_size() == len(locked)
            assert sorted(cache.all_slots().tolist()) == sorted(model.values())
        for node, _ in locks:
            cache.dec_lock(node)
        assert cache.evict_all() == len(model)
        assert cache.total_size() == 0
