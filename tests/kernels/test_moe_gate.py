"""moe_gate (fused grouped top-k) vs moe_gate_ref and vs the engine's router."""

from types import SimpleNamespace

import pytest
import torch

from engine.model.gate_ops import torch_gate, triton_gate
from engine.model.moe import select_experts
from kernels.moe_gate import moe_gate, moe_gate_ref
from kernels.moe_gate import router_gate as fused_router

# (name, E, n_group, topk_group, top_k, norm, scaling): DeepSeek-V3-like (scaled down), V2, V2-Lite
CASES = {
    "noaux_tc": (64, 8, 4, 6, True, 2.5),
    "group_limited_greedy": (160, 8, 3, 6, False, 16.0),
    "greedy": (64, 1, 1, 6, False, 1.0),
}

# On CPU the Triton kernel runs under the interpreter (conftest.py); on a GPU machine the same tests run the
# compiled kernel on CUDA tensors (benchmarks/bench_moe_fp8.py checks it at DeepSeek-V3's shapes too).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(t, e, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(DEV), (torch.randn(e, generator=g) * 0.3).to(DEV)


def _kwargs(method):
    e, ng, tg, k, norm, scale = CASES[method]
    return e, dict(top_k=k, method=method, n_group=ng, topk_group=tg, norm_topk_prob=norm,
                   routed_scaling_factor=scale)


@pytest.mark.parametrize("t", [1, 5, 37])
@pytest.mark.parametrize("method", list(CASES))
def test_gate_matches_ref(method, t):
    e, kw = _kwargs(method)
    logits, bias = _logits(t, e, seed=t + e)
    weights, ids = moe_gate(logits, correction_bias=bias, **kw)
    w_ref, i_ref = moe_gate_ref(logits, correction_bias=bias, **kw)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, i_ref)
    torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-6)
    assert all(len(set(row.tolist())) == kw["top_k"] for row in ids)  # distinct experts per token
    if kw["norm_topk_prob"]:
        torch.testing.assert_close(weights.sum(-1), torch.full((t,), kw["routed_scaling_factor"], device=DEV))


@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("method", list(CASES))
def test_gate_appends_shared_experts(method, n_shared):
    """With n_shared (shared experts fused into the routed launch): the routed columns as without, then ids
    E .. E + n_shared - 1 at weight 1, from the kernel and the reference alike."""
    e, kw = _kwargs(method)
    logits, bias = _logits(6, e, seed=21)
    routed_w, routed_i = moe_gate(logits, correction_bias=bias, **kw)
    weights, ids = moe_gate(logits, correction_bias=bias, n_shared=n_shared, **kw)
    w_ref, i_ref = moe_gate_ref(logits, correction_bias=bias, n_shared=n_shared, **kw)
    k = kw["top_k"]
    assert ids.shape == (6, k + n_shared) and torch.equal(ids, i_ref) and torch.equal(ids[:, :k], routed_i)
    torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights[:, :k], routed_w, rtol=0, atol=0)
    assert (ids[:, k:] == torch.arange(e, e + n_shared, dtype=torch.int32, device=DEV)).all() and (weights[:, k:] == 1).all()


@pytest.mark.parametrize("gate", [torch_gate, triton_gate], ids=["torch", "triton"])
@pytest.mark.parametrize("method", list(CASES))
def test_gate_matches_engine_router(method, gate):
    """The engine's select_experts (engine/model/moe.py) with either gate of engine/model/gate_ops.py is a
    second, independent oracle."""
    e, kw = _kwargs(method)
    t = 23
    logits, bias = _logits(t, e, seed=3)
    cfg = SimpleNamespace(num_experts_per_tok=kw["top_k"], n_routed_experts=e, topk_method=method,
                          scoring_func="sigmoid" if method == "noaux_tc" else "softmax",
                          n_group=kw["n_group"], topk_group=kw["topk_group"],
                          norm_topk_prob=kw["norm_topk_prob"], routed_scaling_factor=kw["routed_scaling_factor"])
    w_eng, i_eng = select_experts(logits, cfg, bias if method == "noaux_tc" else None, gate)
    weights, ids = moe_gate(logits, correction_bias=bias if method == "noaux_tc" else None, **kw)
    order_k, order_e = ids.long().sort(-1), i_eng.sort(-1)
    assert torch.equal(order_k.values, order_e.values)
    torch.testing.assert_close(weights.gather(1, order_k.indices), w_eng.gather(1, order_e.indices),
                               rtol=1e-5, atol=1e-6)


def test_noaux_tc_respects_groups_and_bias():
    """Only experts of the topk_group best groups are chosen; the bias picks, the weights ignore it."""
    e, kw = _kwargs("noaux_tc")
    logits, _ = _logits(9, e, seed=11)
    bias = torch.zeros(e, device=DEV)
    bias[40:48] = 10.0  # group 5 wins every token, its experts lead the choice
    weights, ids = moe_gate(logits, correction_bias=bias, **kw)
    assert ((ids >= 40) & (ids < 48)).sum(-1).min() >= 6
    groups = [set((row // (e // kw["n_group"])).tolist()) for row in ids]
    assert all(len(g) <= kw["topk_group"] for g in groups)
    scores = logits.sigmoid().gather(1, ids.long())
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True) * 2.5)


def test_gate_from_hidden_odd_experts_and_empty():
    """E = 20 experts (not a power of two, nor a whole number of the fused router's 16-expert blocks)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 48, generator=g).bfloat16().to(DEV)
    gate_w = torch.randn(20, 48, generator=g).bfloat16().to(DEV)  # E = 20: not a power of two
    kw = dict(top_k=3, method="greedy", norm_topk_prob=True, routed_scaling_factor=1.0)
    weights, ids = moe_gate(hidden, gate_w, **kw)
    w_ref, i_ref = moe_gate_ref(hidden, gate_w, **kw)
    assert torch.equal(ids, i_ref) and (ids < 20).all()
    torch.testing.assert_close(weights, w_ref)
    w0, i0 = moe_gate(torch.randn(0, 20, device=DEV), top_k=3, method="greedy")
    assert w0.shape == (0, 3) and i0.shape == (0, 3)
    with pytest.raises(ValueError):
        moe_gate(torch.randn(2, 20, device=DEV), top_k=3, method="noaux_tc", n_group=3, topk_group=1)
    with pytest.raises(ValueError):
        moe_gate(torch.randn(2, 20, device=DEV), top_k=3, method="sparsemax")


@pytest.mark.parametrize("t", [1, 2, 4, 5])
@pytest.mark.parametrize("method", list(CASES))
def test_router_from_hidden_in_one_launch(method, t, monkeypatch):
    """From the hidden states and a float32 router weight: from FUSED_MIN_T to FUSED_MAX_T rows the logits are
    computed inside the gate's launch (programs over experts x hidden parts, the last to arrive adds the parts
    and gates), otherwise by a matmul first; both equal the reference (float32 logits, then the gate), shared
    columns included, and the arrival count is back to 0 for the next launch."""
    import kernels.moe_gate as mg
    from kernels import split_k

    fused = []
    monkeypatch.setattr(mg, "router_gate", lambda *a: fused.append(1) or fused_router(*a))
    e, kw = _kwargs(method)
    g = torch.Generator().manual_seed(7 * t + e)
    hidden = torch.randn(t, 640, generator=g).bfloat16().to(DEV)  # 5 steps of 128: parts of unequal length
    gate_w = (torch.randn(e, 640, generator=g) * 0.05).to(DEV)
    bias = (torch.randn(e, generator=g) * 0.3).to(DEV) if method == "noaux_tc" else None
    for n_shared in (0, 1):
        weights, ids = moe_gate(hidden, gate_w, correction_bias=bias, n_shared=n_shared, **kw)
        w_ref, i_ref = moe_gate_ref(hidden, gate_w, correction_bias=bias, n_shared=n_shared, **kw)
        assert torch.equal(ids, i_ref), (t, n_shared)
        torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-6)
    assert int(split_k.arrivals(hidden.device)[0]) == 0
    assert len(fused) == (2 if mg.FUSED_MIN_T <= t <= mg.FUSED_MAX_T else 0)


@pytest.mark.parametrize("t, marked", [(1, 1), (3, 3), (4, 3), (9, 9)])
def test_padding_rows_get_no_expert(t, marked):
    """`pad` marks a padded forward's padding rows (bool, up to T rows: rows past it are routed): their ids,
    routed and shared, come out -1 from the kernel (the plain gate, and the fused router at 2-4 rows) and the
    reference alike, and every other row is routed exactly as without marks."""
    e, kw = _kwargs("noaux_tc")
    g = torch.Generator().manual_seed(t)
    hidden = torch.randn(t, 48, generator=g).to(DEV)
    gate_w = torch.randn(e, 48, generator=g).to(DEV)
    bias = (torch.randn(e, generator=g) * 0.3).to(DEV)
    pad = (torch.arange(marked) % 3 == 1).to(DEV)  # rows 1, 4, 7 of the marked ones
    plain_w, plain_i = moe_gate(hidden, gate_w, correction_bias=bias, n_shared=2, **kw)
    weights, ids = moe_gate(hidden, gate_w, correction_bias=bias, n_shared=2, pad=pad, **kw)
    w_ref, i_ref = moe_gate_ref(hidden, gate_w, correction_bias=bias, n_shared=2, pad=pad, **kw)
    padded = torch.zeros(t, dtype=torch.bool, device=DEV)
    padded[:marked] = pad
    assert torch.equal(ids, i_ref) and (ids[padded] == -1).all()
    assert torch.equal(ids[~padded], plain_i[~padded]) and (ids[~padded] >= 0).all()
    torch.testing.assert_close(weights[~padded], plain_w[~padded], rtol=0, atol=0)
    torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-6)
