"""A pure-torch stand-in for `flashinfer.mla` and `flashinfer.prefill` (CPU tests of dsctl's FlashInfer plumbing).

MLA: the contract dsctl relies on: CSR metadata (qo_indptr, kv_indptr, kv_indices,
kv_len_arr; int32), page size 1, a split query (q_nope, q_pe) and a packed [pages, 1, ckv + kpe]
cache, causal masks aligned to the end of each request's KV, CUDA-graph wrappers whose
metadata buffers are copied into at plan time, and (optionally) the planner internals that
dsctl's per-step re-plan of a CUDA-graph wrapper uses. Prefill: the ragged wrapper's contract (host int32
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
    """Plans write a schedule (the batch's qo / kv indptr and kv lengths) into the wrapper's "device" int workspace,
    as FlashInfer's planner does, and run() reads it there at run time, with page j of request i at
    kv_indices[kv_indptr[i] + j] for j < kv_len[i] (kv_indptr as a base, not a CSR difference: what the real kernel
    reads, and what dsctl's in-place CUDA-graph wrappers rely on). With `internals` (class attribute, set by
    install), a planned wrapper also exposes the FlashInfer 0.7 internals dsctl's re-plan uses: `_planned_backend`
    with its workspaces, metadata buffers and `_cached_module` (a staging proxy over a raw planner that writes the
    schedule to the page-locked workspace only, leaving its copy to the caller)."""

    plans = 0  # public plan() calls across all wrappers
    replans = 0  # raw planner calls (dsctl's re-plan) across all wrappers
    internals = True

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.graph_bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr) if use_cuda_graph else None
        self.kv_indices = kv_indices
        self.int_workspace = torch.zeros(1 << 12, dtype=torch.int32)  # the schedule run() reads
        self.pinned_workspace = torch.zeros(1 << 12, dtype=torch.int32)
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
        else:
            self.kv_indices = m.kv_indices
        n = _write_schedule(self.pinned_workspace, m.qo_indptr, m.kv_indptr, m.kv_len_arr)
        self.int_workspace[:n].copy_(self.pinned_workspace[:n])
        BatchMLAPagedAttentionWrapper.plans += 1
        self.plan_args = dict(heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, causal=causal, scale=sm_scale)
        if BatchMLAPagedAttentionWrapper.internals:
            self._planned_backend = _PlannedBackend(self)

    def run(self, *, query, kv_cache, ckv_scale=None, kpe_scale=None):
        p = self.plan_args
        b = int(self.int_workspace[0])
        qo, kv, lens = (self.int_workspace[1 + i * (b + 1):1 + i * (b + 1) + b + 1].tolist() for i in range(3))
        q_nope, q_pe = query
        assert q_nope.shape[0] == qo[-1] and q_nope.shape[1:] == (p["heads"], p["ckv"])
        assert kv_cache.shape[1:] == (1, p["ckv"] + p["kpe"])
        cache = kv_cache[:, 0].float() * (ckv_scale or 1.0)
        out = torch.empty_like(q_nope)
        for i in range(b):
            q0, q1 = qo[i], qo[i + 1]
            rows = cache[self.kv_indices[kv[i]:kv[i] + lens[i]].long()]
            c, kpe = rows[:, : p["ckv"]], rows[:, p["ckv"]:]
            s = torch.einsum("qhc,kc->hqk", q_nope[q0:q1].float(), c)
            s += torch.einsum("qhr,kr->hqk", q_pe[q0:q1].float(), kpe)
            s *= p["scale"]
            if p["causal"]:
                nq, nk = q1 - q0, lens[i]
                visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
                s.masked_fill_(~visible, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,kc->qhc", s.softmax(-1), c).to(out.dtype)
        return out


def _write_schedule(into: torch.Tensor, qo_indptr, kv_indptr, kv_lens) -> int:
    """[B, qo_indptr (B + 1), kv_indptr (B + 1), kv_lens (B, then one unused)] into `into`; returns its length."""
    b = kv_lens.numel()
    parts = [torch.tensor([b], dtype=torch.int32), qo_indptr[:b + 1], kv_indptr[:b + 1], kv_lens[:b],
             torch.zeros(1, dtype=torch.int32)]
    flat = torch.cat([t.to(torch.int32).cpu() for t in parts])
    into[: flat.numel()] = flat
    return flat.numel()


class _RawPlanner:
    """The JIT module's planner: the schedule into the page-locked workspace; (plan info, bytes to copy)."""

    def plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_lens, num_heads, head_dim, causal):
        BatchMLAPagedAttentionWrapper.replans += 1
        return [0] * 18, 4 * _write_schedule(pinned_ws, qo_indptr, kv_indptr, kv_lens)


class _StagingModule:
    """The staging proxy over the raw planner: plans, then copies the staged bytes itself."""

    def __init__(self):
        self._module = _RawPlanner()

    def plan_with_staged_workspace_bytes(self, float_ws, int_ws, pinned_ws, *rest):
        info, n = self._module.plan(float_ws, int_ws, pinned_ws, *rest)
        int_ws.view(torch.uint8)[:n].copy_(pinned_ws.view(torch.uint8)[:n])
        return info, n


class _PlannedBackend:
    def __init__(self, wrapper: BatchMLAPagedAttentionWrapper):
        bufs = wrapper.graph_bufs or (torch.zeros(0, dtype=torch.int32),) * 4
        self._float_workspace_buffer = torch.zeros(1)
        self._int_workspace_buffer, self._pin_memory_int_workspace_buffer = \
            wrapper.int_workspace, wrapper.pinned_workspace
        self._qo_indptr_buf, self._kv_indptr_buf, _, self._kv_len_arr_buf = bufs
        self._cached_module = _StagingModule()


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


def install(monkeypatch, internals: bool = True) -> None:
    """Make `import flashinfer.mla` / `flashinfer.prefill` return this module's classes for the rest of the test
    (internals: whether planned MLA wrappers expose the FlashInfer 0.7 internals dsctl's re-plan uses)."""
    import importlib.machinery
    import sys

    monkeypatch.setattr(BatchMLAPagedAttentionWrapper, "internals", internals)

    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    pkg = types.ModuleType("flashinfer")
    pkg.mla, pkg.prefill, pkg.__spec__ = mla, prefill, importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
