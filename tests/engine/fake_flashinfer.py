"""A pure-torch stand-in for `flashinfer.mla` and `flashinfer.prefill` (CPU tests of dsctl's FlashInfer plumbing).

MLA: the contract dsctl relies on: CSR metadata (qo_indptr, kv_indptr, kv_indices,
kv_len_arr; int32), page size 1, a split query (q_nope, q_pe) and a packed [pages, 1, ckv + kpe]
cache, causal masks aligned to the end of each request's KV, and CUDA-graph wrappers whose
metadata buffers are copied into at plan time. Prefill: the ragged wrapper's contract (host int32
qo / kv indptr, NHD rows, each request's keys one block, causal masks aligned to the block's end).
It checks what it is given; the GPU tests (tests/gpu/test_flashinfer.py) check the real FlashInfer
against the same references.
"""

from __future__ import annotations

import types

import torch


class MLAPlanMetadata(types.SimpleNamespace):
    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


class BatchMLAPagedAttentionWrapper:
    plans = 0  # plan() calls across all wrappers

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.graph_bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr) if use_cuda_graph else None
        self.plan_args = None

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
             q_data_type, kv_data_type, query_layout, kv_cache_layout):
        m = metadata
        tensors = (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr)
        assert all(t.dtype == torch.int32 for t in tensors)
        assert page_size == 1 and query_layout == "split" and kv_cache_layout == "packed"
        assert torch.equal(m.kv_indptr[1:] - m.kv_indptr[:-1], m.kv_len_arr)
        assert int(m.kv_indptr[-1]) <= m.kv_indices.numel()
        if self.graph_bufs is not None:
            for buf, src in zip(self.graph_bufs, tensors):
                buf[: src.numel()].copy_(src)
        BatchMLAPagedAttentionWrapper.plans += 1
        self.plan_args = dict(qo=m.qo_indptr.tolist(), kv=m.kv_indptr.tolist(), indices=m.kv_indices.clone(),
                              heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, causal=causal, scale=sm_scale)

    def run(self, *, query, kv_cache, ckv_scale=None, kpe_scale=None):
        p = self.plan_args
        q_nope, q_pe = query
        assert q_nope.shape[0] == p["qo"][-1] and q_nope.shape[1:] == (p["heads"], p["ckv"])
        assert kv_cache.shape[1:] == (1, p["ckv"] + p["kpe"])
        cache = kv_cache[:, 0].float() * (ckv_scale or 1.0)
        out = torch.empty_like(q_nope)
        for i in range(len(p["qo"]) - 1):
            q0, q1, k0, k1 = p["qo"][i], p["qo"][i + 1], p["kv"][i], p["kv"][i + 1]
            rows = cache[p["indices"][k0:k1].long()]
            c, kpe = rows[:, : p["ckv"]], rows[:, p["ckv"]:]
            s = torch.einsum("qhc,kc->hqk", q_nope[q0:q1].float(), c)
            s += torch.einsum("qhr,kr->hqk", q_pe[q0:q1].float(), kpe)
            s *= p["scale"]
            if p["causal"]:
                nq, nk = q1 - q0, k1 - k0
                visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
                s.masked_fill_(~visible, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,kc->qhc", s.softmax(-1), c).to(out.dtype)
        return out


class BatchPrefillWithRaggedKVCacheWrapper:
    plans = 0  # plan() calls across all wrappers
    runs = 0  # run() calls across all wrappers

    def __init__(self, workspace, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD"
        self.plan_args = None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        for t in (qo_indptr, kv_indptr):
            assert t.dtype == torch.int32 and t.device.type == "cpu" and int(t[0]) == 0
        assert qo_indptr.numel() == kv_indptr.numel() and num_qo_heads == num_kv_heads
        assert bool(((kv_indptr[1:] - kv_indptr[:-1]) >= (qo_indptr[1:] - qo_indptr[:-1])).all())
        BatchPrefillWithRaggedKVCacheWrapper.plans += 1
        self.plan_args = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), heads=num_qo_heads, dqk=head_dim_qk,
                              dv=head_dim_vo or head_dim_qk, causal=causal, scale=sm_scale)

    def run(self, q, k, v, out=None):
        p = self.plan_args
        assert q.shape == (p["qo"][-1], p["heads"], p["dqk"]) and k.shape == (p["kv"][-1], p["heads"], p["dqk"])
        assert v.shape == (p["kv"][-1], p["heads"], p["dv"])
        BatchPrefillWithRaggedKVCacheWrapper.runs += 1
        out = q.new_empty(q.shape[0], p["heads"], p["dv"]) if out is None else out
        for i in range(len(p["qo"]) - 1):
            q0, q1, k0, k1 = p["qo"][i], p["qo"][i + 1], p["kv"][i], p["kv"][i + 1]
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double()) * p["scale"]
            if p["causal"]:
                nq, nk = q1 - q0, k1 - k0
                visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
                s.masked_fill_(~visible, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khv->qhv", s.softmax(-1), v[k0:k1].double()).to(out.dtype)
        return out


def install(monkeypatch) -> None:
    """Make `import flashinfer.mla` / `flashinfer.prefill` return this module's classes for the rest of the test."""
    import importlib.machinery
    import sys

    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    pkg = types.ModuleType("flashinfer")
    pkg.mla, pkg.prefill, pkg.__spec__ = mla, prefill, importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
