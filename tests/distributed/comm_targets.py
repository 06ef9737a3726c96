"""Rank bodies for the multi-process collective tests (gloo on CPU). Each rank checks its own results
against values it computes locally from every rank's seed, and raises on a mismatch: the supervisor
then reports that rank and its assertion."""

import torch


def _rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def comm_checks(local_rank: int, pc) -> None:
    import torch.nn.functional as F

    from engine.distributed import comm
    from engine.distributed.groups import init_parallel
    from engine.weights.sharding import shard_spec

    state = init_parallel(pc, local_rank, "cpu")
    g = state.tp
    r, n = g.rank, g.size
    assert (state.world_rank, state.world_size, state.backend) == (pc.global_rank(local_rank), n, "gloo")
    assert g.ranks == tuple(range(n)) and r == state.world_rank

    # all_reduce: sum in place
    x = _rand(100 + r, 3, 5)
    assert comm.all_reduce(x, g) is x
    torch.testing.assert_close(x, sum(_rand(100 + q, 3, 5) for q in range(n)))

    # all_gather along the last dim, rank order, 2-D and 3-D
    for shape in ((2, 3), (2, 4, 3)):
        got = comm.all_gather_last_dim(_rand(200 + r, *shape), g)
        assert torch.equal(got, torch.cat([_rand(200 + q, *shape) for q in range(n)], dim=-1)), shape

    # vocab-parallel lm_head: each rank's logits slice, gathered == the full product
    h, vocab = 8, 4 * n
    w, hid = _rand(7, vocab, h), _rand(8, 3, h)
    spec = shard_spec("lm_head", w.shape, r, n)
    torch.testing.assert_close(comm.all_gather_last_dim(F.linear(hid, spec.apply(w)), g), F.linear(hid, w))
    # row-parallel o_proj: partial products summed == the full product
    wo, v = _rand(9, h, 2 * n), _rand(10, 3, 2 * n)
    spec = shard_spec("layers.0.self_attn.o_proj.weight", wo.shape, r, n)
    out = comm.all_reduce(F.linear(spec.apply(v), spec.apply(wo)), g)
    torch.testing.assert_close(out, F.linear(v, wo), rtol=1e-5, atol=1e-5)

    # objects from the last rank (a scheduler message), tensors from rank 1 (sampled ids)
    src = n - 1
    msg = comm.broadcast_object({"step": 7, "from": r, "ids": [r] * 3} if r == src else None, src, g)
    assert msg == {"step": 7, "from": src, "ids": [src] * 3}
    ids = torch.full((4,), 10 * r, dtype=torch.int64)
    assert comm.broadcast_tensor(ids, 1, g) is ids and ids.tolist() == [10] * 4

    # every rank proposes a KV pool size; all agree on the smallest
    proposals = [5000 - 300 * ((q * 7) % n) for q in range(n)]
    assert comm.all_reduce_min_int(proposals[r], g) == min(proposals)
    token_exchange_checks(g)
    async_checks(g)
    comm.barrier(g)
    state.destroy()
    assert not torch.distributed.is_initialized()


def token_exchange_checks(g) -> None:
    """EP all-to-all (engine/distributed/token_exchange.py), both modes, against the sum each rank computes
    itself: expert e scales a row by (e + 1), so a wrong id mapping, a lost or doubled slot or a row returned
    to the wrong place changes the result. Rank 1 sends no rows in the variable mode."""
    from engine.distributed.token_exchange import gather_shares, token_share, torch_all_to_all

    r, n, per_rank, k, h = g.rank, g.size, 3, 4, 8

    def experts(rows, w, local_ids):  # what rank r's experts do: weight x (global id + 1) x row, summed
        scale = torch.where(local_ids >= 0, w * (local_ids + r * per_rank + 1), torch.zeros_like(w))
        return rows * scale.sum(1, keepdim=True)

    def routed(seed: int, t: int):
        gen = torch.Generator().manual_seed(seed)
        rows = [torch.randperm(n * per_rank, generator=gen)[:k] for _ in range(t)]
        ids = torch.stack(rows).to(torch.int32) if rows else torch.empty(0, k, dtype=torch.int32)
        ids[1:2, 0], ids[2:3, 1] = n * per_rank, -1  # ids of no expert (uninitialised router output): dropped
        return _rand(seed, t, h), torch.rand(t, k, generator=gen), ids

    for fixed, t in ((False, 0 if r == 1 else 3 + 2 * r), (True, 5)):
        x, w, ids = routed(300 + r, t)
        got = torch_all_to_all(x, w, ids, experts, g, per_rank, fixed)
        valid = (ids >= 0) & (ids < n * per_rank)
        want = x * (w * (ids + 1) * valid).sum(1, keepdim=True)
        torch.testing.assert_close(got, want, msg=f"fixed={fixed}")
    t = 7  # the rows one attention group holds, shared out and gathered back
    start, end, per = token_share(t, g)
    x = _rand(400, t, h)
    torch.testing.assert_close(gather_shares(2 * x[start:end], t, per, g), 2 * x)


def async_checks(g) -> None:
    """Two-batch overlap's forms: collectives started asynchronously, several in flight, waited for out of order,
    and the token exchange's steps of two micro-batches interleaved: the results of the plain forms."""
    from engine.distributed import comm
    from engine.distributed.token_exchange import torch_all_to_all
    from engine.model.two_batch import interleave

    r, n = g.rank, g.size
    x = _rand(500 + r, 4, 6)
    summed = comm.start_all_reduce(x.clone(), g)
    rows = comm.start_all_gather_padded_rows(_rand(600 + r, r + 1, 6), n, g)
    torch.testing.assert_close(rows.wait(), comm.all_gather_padded_rows(_rand(600 + r, r + 1, 6), n, g))
    torch.testing.assert_close(summed.wait(), sum(_rand(500 + q, 4, 6) for q in range(n)))
    per_rank, k = 2, 2

    def experts(rows, w, local_ids):
        scale = torch.where(local_ids >= 0, w * (local_ids + r * per_rank + 1), torch.zeros_like(w))
        return rows * scale.sum(1, keepdim=True)

    def batch(seed: int, t: int):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(n * per_rank, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        return _rand(seed, t, 6), torch.rand(t, k, generator=gen), ids

    for fixed in (False, True):
        a, b = batch(700 + r, 3), batch(800 + r, 2 if fixed else 1 + r)
        got = interleave(torch_all_to_all.stages(*a, experts, g, per_rank, fixed),
                         torch_all_to_all.stages(*b, experts, g, per_rank, fixed))
        for out, args in zip(got, (a, b)):
            torch.testing.assert_close(out, torch_all_to_all(*args, experts, g, per_rank, fixed))


def fail_in_collective(local_rank: int, pc) -> None:
    """Rank 1 raises before the all-reduce its peers are blocked in."""
    from engine.distributed import comm
    from engine.distributed.groups import init_parallel

    state = init_parallel(pc, local_rank, "cpu")
    if state.world_rank == 1:
        raise RuntimeError("rank 1 ran out of memory (simulated)")
    comm.all_reduce(torch.ones(3), state.tp)
