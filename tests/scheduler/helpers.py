"""Shared helpers of the scheduler tests: swap a fresh scheduler into an engine, and check that one that
has finished everything left the KV pool, the prefix cache and the request table clean."""

from __future__ import annotations

import torch


def drop_scheduler(engine) -> None:
    """Finish the engine's current scheduler and evict what its prefix cache holds (before replacing it)."""
    old = engine.scheduler
    old.flush()
    if old.cache is not None:
        old.cache.evict_all()


def swap_scheduler(engine, **flags):
    """A fresh scheduler with these scheduling flags in place of the engine's current one; returns it."""
    drop_scheduler(engine)
    engine.scheduler = engine.make_scheduler(**flags)
    return engine.scheduler


def assert_settled(engine, sched) -> None:
    """Nothing runs; every slot is free or held by the cache, exactly once; nothing is locked; all request
    rows are back."""
    sched.flush()
    assert not sched.has_work()
    pool = engine.runner.kv_pool
    held = sched.cache.all_slots() if sched.cache else torch.empty(0, dtype=torch.int64)
    assert pool.available() + sched.mem.cache_tokens() == pool.size
    assert torch.cat((pool.free_slots(), held)).sort().values.tolist() == list(range(1, pool.size + 1))
    if sched.cache:
        assert sched.cache.protected_size() == 0
    assert engine.runner.req_to_token.available() == engine.args.scheduler.max_running_requests
