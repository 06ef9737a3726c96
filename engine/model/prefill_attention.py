"""Expanded prefill attention: an extend group's new tokens attend causally to each other and fully to their
requests' cached prefixes, with per-head keys / values (MLA's latent expanded by kv_b_proj).

The Triton attention backend hands its expanded runs here (engine/model/attention_triton.py; also under
flashinfer-decode, whose extends run that backend), and so does --disable-mla's Triton backend for its
extend groups (engine/model/attention_expanded.py). The `prefill_attention` op of
engine/model/kernel_registry.py (--prefill-attention-backend) picks one of:

- `TritonPrefill`: kernels/mla_extend.py's packed extend kernel (prefix and new tokens as separate tensors);
- `TorchPrefill`: its pure-torch reference (one request at a time);
- `FlashInferPrefill`: FlashInfer's batch prefill over ragged keys (its fa3 kernel on Hopper; measured 1.6-2.3x
  faster than the Triton kernel at 16 and 128 heads, 1k-16k tokens, docs/perf.md). FlashInfer reads each
  request's keys as one block [prefix; new] (causal masks align to the block's end), so a group with cached
  prefixes is copied into that layout first; groups of fewer than FLASHINFER_MIN_TOKENS new tokens run the
  Triton kernel (FlashInfer's host planning would cost more than its kernel saves).

Every implementation is planned once per forward with the forward's groups (`plan`, which returns the
forward's `PrefillPlan`), then called per layer with that plan and one group (`attend`); the groups are
consecutive requests [r0, r1) of the forward batch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from engine.forward_batch import ForwardBatch, to_device
from kernels.mla_extend import extend_attention, extend_attention_ref

FLASHINFER_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace (split partial outputs)
FLASHINFER_MIN_TOKENS = 512  # new tokens of a group below which the Triton kernel runs instead (no host plan)
FLASHINFER_HEAD_DIMS = ((192, 128),)  # (qk, v) per head: DeepSeek's, the pair measured (docs/perf.md)


@dataclass(frozen=True)
class PrefillGroup:
    """Consecutive requests [r0, r1) of a forward batch that attend in one call."""

    r0: int
    r1: int
    max_extend: int  # the most new tokens of one of its requests


def group_lens(fb: ForwardBatch, group: PrefillGroup) -> tuple[list[int], list[int]]:
    """(new tokens, cached prefix tokens) per request of the group, host ints."""
    return fb.extend_lens_cpu[group.r0:group.r1], fb.prefix_lens_cpu[group.r0:group.r1]


@dataclass(frozen=True)
class PrefillPlan:
    """What `plan` made for one forward: its batch and groups (and an implementation's own per-group state). The
    attention backend keeps it, so that copies of a backend (two-batch overlap's micro-batches) plan apart."""

    fb: ForwardBatch
    groups: list[PrefillGroup]
    ragged: Optional[list] = None  # FlashInferPrefill: one _RaggedGroup per group


class TritonPrefill:
    """kernels/mla_extend.extend_attention; nothing to plan but the groups."""

    name = "triton"
    prefix_copies = 1  # copies of a group's expanded prefix alive during `attend` (the callers' memory budget)

    def plan(self, fb: ForwardBatch, groups: list[PrefillGroup]) -> PrefillPlan:
        return PrefillPlan(fb, groups)

    def attend(self, plan: PrefillPlan, i: int, q, k, v, k_prefix, v_prefix, scale: float, out: torch.Tensor) -> None:
        """Group i of the plan: q, k [T, H, qk], v [T, H, v] of its new tokens, k_prefix / v_prefix its
        requests' prefixes concatenated (empty: none); writes out [T, H, v]."""
        g, fb = plan.groups[i], plan.fb
        extend_attention(q, k, v, k_prefix, v_prefix, fb.extend_lens[g.r0:g.r1], fb.prefix_lens[g.r0:g.r1], scale,
                         max_extend_len=g.max_extend, out=out)


class TorchPrefill(TritonPrefill):
    """The reference: extend_attention_ref (float32 softmax, one request at a time)."""

    name = "torch"

    def attend(self, plan: PrefillPlan, i: int, q, k, v, k_prefix, v_prefix, scale: float, out: torch.Tensor) -> None:
        g, fb = plan.groups[i], plan.fb
        out.copy_(extend_attention_ref(q, k, v, k_prefix, v_prefix, fb.extend_lens[g.r0:g.r1],
                                       fb.prefix_lens[g.r0:g.r1], scale))


def ragged_rows(extend_lens: list[int], prefix_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Where a group's rows go in FlashInfer's ragged key layout (each request's block [prefix; new]):
    (kv_indptr, the ragged row of every new token in order, the ragged row of every prefix token in order)."""
    indptr, new_rows, prefix_rows = [0], [], []
    for n, p in zip(extend_lens, prefix_lens):
        start = indptr[-1]
        prefix_rows += range(start, start + p)
        new_rows += range(start + p, start + p + n)
        indptr.append(start + p + n)
    return indptr, new_rows, prefix_rows


@dataclass
class _RaggedGroup:
    """One group's FlashInfer plan: its wrapper (None: the Triton kernel runs it) and, with prefixes, where its
    new and prefix rows go in the ragged [prefix; new] key layout."""

    wrapper: Optional[object]
    kv_rows: int = 0
    new_rows: Optional[torch.Tensor] = None
    prefix_rows: Optional[torch.Tensor] = None


class FlashInferPrefill:
    """FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, one wrapper per group of a forward (kept across
    forwards, so one forward's plan at a time: not with two-batch overlap). FlashInfer is imported lazily, when
    this is built on a CUDA device."""

    name = "flashinfer"
    prefix_copies = 2  # the expanded prefix and its ragged copy

    def __init__(self, num_heads: int, head_dim_qk: int, head_dim_v: int, sm_scale: float, dtype: torch.dtype,
                 device: torch.device):
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper  # lazy: CUDA-only dependency

        self._wrapper_cls = BatchPrefillWithRaggedKVCacheWrapper
        self.num_heads, self.head_dim_qk, self.head_dim_v = num_heads, head_dim_qk, head_dim_v
        self.sm_scale, self.dtype, self.device = sm_scale, dtype, device
        self.workspace: Optional[torch.Tensor] = None  # allocated by the first plan
        self.wrappers: list[object] = []
        self.small = TritonPrefill()  # groups under FLASHINFER_MIN_TOKENS new tokens
        self._plan_copied: Optional[torch.cuda.Event] = None

    def plan(self, fb: ForwardBatch, groups: list[PrefillGroup]) -> PrefillPlan:
        if self._plan_copied is not None:
            # plan() stages its schedule in a page-locked host buffer copied to the GPU asynchronously: wait
            # until the previous forward's copies have left those buffers before rewriting them (the overlap
            # scheduler plans step N+1 while step N is still queued).
            self._plan_copied.synchronize()
        if self.workspace is None:
            self.workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        while len(self.wrappers) < len(groups):
            self.wrappers.append(self._wrapper_cls(self.workspace, kv_layout="NHD"))
        ragged = [self._plan_group(self.wrappers[i], *group_lens(fb, g)) for i, g in enumerate(groups)]
        if self.device.type == "cuda" and any(r.wrapper is not None for r in ragged):
            self._plan_copied = self._plan_copied or torch.cuda.Event()
            self._plan_copied.record()
        return PrefillPlan(fb, groups, ragged)

    def _plan_group(self, wrapper, extend_lens: list[int], prefix_lens: list[int]) -> _RaggedGroup:
        if sum(extend_lens) < FLASHINFER_MIN_TOKENS:
            return _RaggedGroup(None)
        kv_indptr, new_rows, prefix_rows = ragged_rows(extend_lens, prefix_lens)
        qo_indptr = torch.tensor([0, *extend_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        wrapper.plan(qo_indptr, torch.tensor(kv_indptr, dtype=torch.int32), self.num_heads, self.num_heads,
                     self.head_dim_qk, head_dim_vo=self.head_dim_v, causal=True, sm_scale=self.sm_scale,
                     q_data_type=self.dtype, kv_data_type=self.dtype)
        if not prefix_rows:
            return _RaggedGroup(wrapper)
        return _RaggedGroup(wrapper, kv_indptr[-1], to_device(new_rows, self.device),
                            to_device(prefix_rows, self.device))

    def attend(self, plan: PrefillPlan, i: int, q, k, v, k_prefix, v_prefix, scale: float, out: torch.Tensor) -> None:
        """As TritonPrefill.attend; the softmax scale is the one planned with (the model's, every layer's)."""
        g = plan.ragged[i]
        if g.wrapper is None:
            return self.small.attend(plan, i, q, k, v, k_prefix, v_prefix, scale, out)
        if g.prefix_rows is not None:
            k = _ragged(k, k_prefix, g)
            v = _ragged(v, v_prefix, g)
        g.wrapper.run(q.contiguous(), k.contiguous(), v.contiguous(), out=out)


def _ragged(new: torch.Tensor, prefix: torch.Tensor, g: _RaggedGroup) -> torch.Tensor:
    """New and prefix rows interleaved per request into the ragged [prefix; new] layout."""
    rows = new.new_empty(g.kv_rows, *new.shape[1:])
    rows.index_copy_(0, g.new_rows, new)
    rows.index_copy_(0, g.prefix_rows, prefix)
    return rows


def flashinfer_prefill_unavailable(head_dims: tuple[int, int], dtype: torch.dtype,
                                   device: torch.device) -> Optional[str]:
    """Why FlashInfer's prefill cannot run here (None: it can)."""
    if device.type != "cuda":
        return "FlashInfer needs a CUDA GPU"
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer is not installed (pip install flashinfer-python)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashInfer's prefill runs bfloat16 / float16 activations, not {dtype}"
    if head_dims not in FLASHINFER_HEAD_DIMS:
        return f"head dims (qk, v) = {head_dims}: FlashInfer's prefill is wired and measured for {FLASHINFER_HEAD_DIMS}"
    return None
