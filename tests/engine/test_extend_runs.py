"""The Triton backend's extend plan: prefix-cache hits attend in latent space, long extends run in
groups whose expanded prefixes fit a budget, and the result equals the torch reference either way.

Runs the Triton kernels in the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on one
MLA layer of the `tiny` config with random weights and a random latent cache.
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.model.attention import MLA, TorchAttentionBackend
from engine.model.attention_triton import AbsorbedRun, ExpandedRun, TritonAttentionBackend, plan_extend
from engine.model.context import ForwardContext

PREFIX = [0, 20, 30, 25, 5, 0]
EXTEND = [7, 3, 20, 18, 1, 4]  # requests 1 and 4 are prefix-cache hits (short extends over a prefix)


def _setup(prefix=PREFIX, extend=EXTEND):
    cfg = parse_config(lookup("tiny").config_dict())
    g = torch.Generator().manual_seed(0)
    layer = MLA(cfg, 0, torch.float32)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    layer.absorb()
    pool = KVPool(1, 400, cfg.kv_cache_dim, torch.float32, torch.device("cpu"))
    pool.write(0, torch.arange(pool.size + 1), torch.randn(pool.size + 1, cfg.kv_cache_dim, generator=g))
    table = ReqToTokenPool(8, 128, torch.device("cpu"))
    perm = torch.randperm(pool.size, generator=g) + 1
    rows, start = [], 0
    for i, (p, n) in enumerate(zip(prefix, extend)):
        table.set(i, 0, perm[start:start + p + n])
        rows.append(i)
        start += p + n
    out_loc = torch.cat([table.slots(i, p + n, p) for i, (p, n) in enumerate(zip(prefix, extend))])
    fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * sum(extend), rows, prefix, extend, out_loc,
                            list(range(sum(extend))), torch.device("cpu"))
    return cfg, layer, pool, table, fb, g


def test_plan_groups_hits_and_bounds_expanded_prefixes():
    _, _, _, table, fb, _ = _setup()
    runs = plan_extend(fb, table.table, prefix_token_budget=40)
    kinds = [(type(r).__name__, r.t0, r.t1) for r in runs]
    assert kinds == [("ExpandedRun", 0, 7), ("AbsorbedRun", 7, 10), ("ExpandedRun", 10, 30),
                     ("ExpandedRun", 30, 48), ("AbsorbedRun", 48, 49), ("ExpandedRun", 49, 53)]
    hit = runs[1]
    assert isinstance(hit, AbsorbedRun)
    assert hit.rows_req.tolist() == [1, 1, 1] and hit.rows_len.tolist() == [21, 22, 23]
    expanded = [r for r in runs if isinstance(r, ExpandedRun)]
    assert [r.prefix_slots is None for r in expanded] == [True, False, False, True]
    assert all(r.prefix_slots is None or r.prefix_slots.numel() <= 40 for r in expanded)
    # a large budget keeps consecutive expanded requests together
    assert len(plan_extend(fb, table.table, prefix_token_budget=10_000)) == 5


@pytest.mark.parametrize("alone", [False, True])  # default budget; a 1-token budget: each expanded request alone
def test_triton_extend_runs_match_torch_reference(alone):
    cfg, layer, pool, table, fb, g = _setup()
    t, h = fb.num_tokens, layer.num_heads
    q_nope = torch.randn(t, h, layer.nope, generator=g)
    q_pe = torch.randn(t, h, layer.rope_dim, generator=g)
    new = pool.read(0, fb.out_cache_loc, torch.float32)  # the new tokens' latent, as MLA.forward wrote it
    c_kv, k_pe = new[:, : cfg.kv_lora_rank], new[:, cfg.kv_lora_rank:]
    outs = {}
    per_token = h * (layer.nope + layer.rope_dim + layer.v_dim) * 4
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend(per_token))):
        if alone and name == "triton":
            backend.prefix_token_budget = 1
        ctx = ForwardContext(pool, table, None, backend, moe_backend=None)
        ctx.begin_forward(fb)
        outs[name] = backend.extend(layer, q_nope, q_pe, c_kv, k_pe, fb, ctx)
    if alone:
        assert sum(isinstance(r, ExpandedRun) for r in backend.runs) == 4
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-2, rtol=2e-2)
    assert outs["torch"].abs().max() > 0.1


def test_mixed_batch_decode_rows_equal_a_decode_step():
    """A mixed batch (scheduler.py, --enable-mixed-chunk): prefill chunks, then running requests as extends of
    one token on their KV. Both backends' extend rows of those requests equal what a decode step gives them."""
    prefix, extend = [12, 0, 40, 3, 61], [20, 11, 1, 1, 1]
    cfg, layer, pool, table, fb, g = _setup(prefix, extend)
    t, h = fb.num_tokens, layer.num_heads
    q_nope = torch.randn(t, h, layer.nope, generator=g)
    q_pe = torch.randn(t, h, layer.rope_dim, generator=g)
    new = pool.read(0, fb.out_cache_loc, torch.float32)
    c_kv, k_pe = new[:, : cfg.kv_lora_rank], new[:, cfg.kv_lora_rank:]
    per_token = h * (layer.nope + layer.rope_dim + layer.v_dim) * 4
    triton = TritonAttentionBackend(per_token)
    outs = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", triton)):
        ctx = ForwardContext(pool, table, None, backend, moe_backend=None)
        ctx.begin_forward(fb)
        outs[name] = backend.extend(layer, q_nope, q_pe, c_kv, k_pe, fb, ctx)
    assert [type(r).__name__ for r in triton.runs] == ["ExpandedRun", "AbsorbedRun"]  # the decodes: one run
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-2, rtol=2e-2)
    dec = ForwardBatch.build(ForwardMode.DECODE, [0] * 3, [2, 3, 4], prefix[2:], [1, 1, 1], fb.out_cache_loc[-3:],
                             [0, 1, 2], torch.device("cpu"))
    ctx = ForwardContext(pool, table, None, TorchAttentionBackend(), moe_backend=None)
    ref = ctx.attn_backend.decode(layer, q_nope[-3:], q_pe[-3:], dec, ctx)
    torch.testing.assert_close(outs["torch"][-3:], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["triton"][-3:], ref, atol=2e-2, rtol=2e-2)
    assert ref.abs().max() > 0.1
