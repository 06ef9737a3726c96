"""Triton MLA attention backend (kernels/mla_decode.py, kernels/mla_extend.py).

- extend: the new tokens' k_nope / v come from kv_b_proj on their fresh latent; a
  cached prefix is read back from the latent cache and expanded the same way; the
  expanded prefill (engine/model/prefill_attention.py: the packed varlen Triton kernel,
  or FlashInfer's batch prefill) attends causally over new tokens and fully over the prefix.
  Expanding a prefix costs heads x (qk + v) values per token (80 KB at 128 heads), so
  the transient memory of a step is bounded (`plan_extend`, once per forward): a
  request that adds at most ABSORB_MAX_EXTEND tokens to a cached prefix (a prefix-cache
  hit, a retracted request resuming) attends in latent space like decode, one query
  row per new token, nothing expanded; the other requests run in consecutive groups
  whose expanded prefixes fit in PREFIX_EXPAND_BYTES (a lone request with a longer
  prefix runs by itself).
- decode: q_nope is absorbed into latent space (bmm with W_UK, or the FP8 bmm when
  the weights are FP8), the split-KV decode kernel reads the paged latent cache
  directly (bf16 or FP8 with a scale), and the latent output goes back through W_UV.

Every decode launch has fixed shapes and reads lengths from device tensors, so a
decode step can be captured in a CUDA graph. The kernel calls are opaque to
torch.compile (`torch.compiler.disable`): it compiles the code between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from engine.forward_batch import ForwardBatch, to_device
from engine.model.attention import MLA
from engine.model.context import ForwardContext
from engine.model.prefill_attention import PrefillGroup, PrefillPlan, TritonPrefill
from kernels.fp8 import fp8_bmm
from kernels.mla_decode import mla_decode


def absorbed_query(layer: MLA, q_nope: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, nope] -> q in latent space [B, H, kv_lora] (W_UK folded in); contiguous with FP8 weights (the
    batched matmul writes token-major rows, so the decode kernel reads it without a copy)."""
    if layer.w_kc_fp8 is not None:
        return _fp8_bmm_token_major(q_nope, layer.w_kc_fp8, layer.w_kc_scale)
    return torch.bmm(q_nope.transpose(0, 1), layer.w_kc).transpose(0, 1)


def latent_to_values(layer: MLA, out_lat: torch.Tensor) -> torch.Tensor:
    """Latent attention output [B, H, kv_lora] -> per-head values [B, H, v] (W_UV); contiguous with FP8 weights,
    so that o_proj's input [B, H * v] is a view, not a copy."""
    if layer.w_vc_fp8 is not None:
        return _fp8_bmm_token_major(out_lat, layer.w_vc_fp8, layer.w_vc_scale)
    return torch.bmm(out_lat.transpose(0, 1), layer.w_vc.transpose(1, 2)).transpose(0, 1)


def _fp8_bmm_token_major(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, H, K] @ w[h] [K, N] per head -> [B, H, N] contiguous: the head-major product written through a
    transposed view of a token-major buffer."""
    out = x.new_empty(x.shape[0], x.shape[1], w.shape[2])
    fp8_bmm(x.transpose(0, 1), w, scale, out=out.transpose(0, 1))
    return out


ABSORB_MAX_EXTEND = 16  # new tokens over a cached prefix up to which a request attends in latent space
PREFIX_EXPAND_BYTES = 1 << 30  # expanded prefix K/V of one extend launch, its copies included (a lone request may exceed it)


@dataclass(frozen=True)
class AbsorbedRun:
    """Token rows [t0, t1) of requests that attend in latent space: each row is one query of the
    decode kernel, reading its request's table row up to (and including) its own token."""
    t0: int
    t1: int
    rows_req: torch.Tensor  # [t1 - t0] req->token table row of each query
    rows_len: torch.Tensor  # [t1 - t0] tokens each query sees (prefix + its position + 1)


@dataclass(frozen=True)
class ExpandedRun:
    """Consecutive requests [r0, r1) (token rows [t0, t1)) run by the packed extend kernel."""
    t0: int
    t1: int
    r0: int
    r1: int
    prefix_slots: Optional[torch.Tensor]  # their cached prefixes' KV slots, concatenated (None: no prefix)
    max_extend: int


ExtendRun = Union[AbsorbedRun, ExpandedRun]


def plan_extend(fb: ForwardBatch, table: torch.Tensor, prefix_token_budget: int) -> list[ExtendRun]:
    """Split an extend batch into runs (see the module docstring), in token order."""
    runs: list[ExtendRun] = []
    t, r = 0, 0
    n_reqs = len(fb.extend_lens_cpu)
    rows = fb.host_req_rows()
    while r < n_reqs:
        absorbed = _absorbs(fb, r)
        r1, t1, prefix = r, t, 0
        while r1 < n_reqs and _absorbs(fb, r1) == absorbed and (
                absorbed or r1 == r or prefix + fb.prefix_lens_cpu[r1] <= prefix_token_budget):
            prefix += fb.prefix_lens_cpu[r1]
            t1 += fb.extend_lens_cpu[r1]
            r1 += 1
        runs.append(_absorbed_run(fb, rows, r, r1, t, t1) if absorbed else _expanded_run(fb, rows, table, r, r1, t, t1))
        r, t = r1, t1
    return runs


def _absorbs(fb: ForwardBatch, i: int) -> bool:
    return fb.prefix_lens_cpu[i] > 0 and fb.extend_lens_cpu[i] <= ABSORB_MAX_EXTEND


def _absorbed_run(fb: ForwardBatch, rows: list[int], r0: int, r1: int, t0: int, t1: int) -> AbsorbedRun:
    req, lens = [], []
    for i in range(r0, r1):
        n, p = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
        req += [rows[i]] * n
        lens += range(p + 1, p + n + 1)
    dev = fb.req_pool_indices.device  # non-blocking copies (see forward_batch.tensor_to_device)
    return AbsorbedRun(t0, t1, to_device(req, dev), to_device(lens, dev))


def _expanded_run(fb: ForwardBatch, rows: list[int], table: torch.Tensor, r0: int, r1: int,
                  t0: int, t1: int) -> ExpandedRun:
    parts = [table[rows[i], :fb.prefix_lens_cpu[i]] for i in range(r0, r1) if fb.prefix_lens_cpu[i]]
    slots = torch.cat(parts).to(torch.int64) if parts else None
    return ExpandedRun(t0, t1, r0, r1, slots, max(fb.extend_lens_cpu[r0:r1], default=0))


class TritonAttentionBackend:
    def __init__(self, prefix_token_bytes: int, num_kv_splits: int | None = None, prefill=None):
        """prefix_token_bytes: what expanding one cached token costs (heads x (qk + v) x element size);
        prefill: the expanded prefill attention (engine/model/prefill_attention.py; default the Triton kernel)."""
        self.num_kv_splits = num_kv_splits
        self.prefill = prefill or TritonPrefill()
        self.prefix_token_budget = max(1, PREFIX_EXPAND_BYTES // (prefix_token_bytes * self.prefill.prefix_copies))
        self.runs: list[ExtendRun] = []
        self.prefill_plan: Optional[PrefillPlan] = None

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        """Extend batches: plan the runs, and the expanded runs' prefill, once for every layer (decode reads
        lengths from device tensors)."""
        self.runs = [] if fb.mode.is_decode else plan_extend(fb, ctx.req_to_token.table, self.prefix_token_budget)
        expanded = [PrefillGroup(r.r0, r.r1, r.max_extend) for r in self.runs if isinstance(r, ExpandedRun)]
        self.prefill_plan = self.prefill.plan(fb, expanded) if expanded else None

    @torch.compiler.disable
    def extend(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, ctx: ForwardContext):
        out = q_nope.new_empty(q_nope.shape[0], layer.num_heads, layer.v_dim)
        group = 0
        for run in self.runs:
            if isinstance(run, AbsorbedRun):
                out[run.t0:run.t1] = self._absorbed(layer, q_nope[run.t0:run.t1], q_pe[run.t0:run.t1], run, ctx)
            else:
                self._expanded(layer, q_nope, q_pe, c_kv, k_pe, ctx, run, group, out[run.t0:run.t1])
                group += 1
        return out

    def _absorbed(self, layer: MLA, q_nope, q_pe, run: AbsorbedRun, ctx: ForwardContext) -> torch.Tensor:
        pool = ctx.kv_pool
        out_lat = mla_decode(absorbed_query(layer, q_nope).contiguous(), q_pe.contiguous(),
                             pool.buffer[layer.layer_id], ctx.req_to_token.table, run.rows_req, run.rows_len,
                             layer.scale, num_kv_splits=self.num_kv_splits, kv_scale=pool.scale)
        return latent_to_values(layer, out_lat.to(q_nope.dtype))

    def _expanded(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, ctx: ForwardContext, run: ExpandedRun,
                  group: int, out: torch.Tensor) -> None:
        """The expanded run that is group `group` of the prefill's plan."""
        sl = slice(run.t0, run.t1)
        t, h = run.t1 - run.t0, layer.num_heads
        k_nope, v = layer.expand_latent(c_kv[sl])
        q = torch.cat((q_nope[sl], q_pe[sl]), dim=-1)
        k = torch.cat((k_nope, k_pe[sl, None, :].expand(t, h, -1)), dim=-1)
        kp, vp = self._prefix_kv(layer, run.prefix_slots, ctx, c_kv.dtype)
        self.prefill.attend(self.prefill_plan, group, q, k, v.contiguous(), kp, vp, layer.scale, out)

    def _prefix_kv(self, layer: MLA, slots: Optional[torch.Tensor], ctx: ForwardContext, dtype):
        h, dqk = layer.num_heads, layer.nope + layer.rope_dim
        if slots is None:
            empty = torch.empty(0, h, dqk, dtype=dtype, device=ctx.kv_pool.device)
            return empty, empty[..., : layer.v_dim]
        cached = ctx.kv_pool.read(layer.layer_id, slots, dtype)
        k_nope, v = layer.expand_latent(cached[:, : layer.kv_lora_rank])
        k_pe = cached[:, None, layer.kv_lora_rank:].expand(-1, h, -1)
        return torch.cat((k_nope, k_pe), dim=-1), v.contiguous()

    @torch.compiler.disable
    def decode(self, layer: MLA, q_nope, q_pe, fb: ForwardBatch, ctx: ForwardContext):
        q_lat = absorbed_query(layer, q_nope)
        pool = ctx.kv_pool
        out_lat = mla_decode(q_lat.contiguous(), q_pe.contiguous(), pool.buffer[layer.layer_id],
                             ctx.req_to_token.table, fb.req_pool_indices, fb.seq_lens, layer.scale,
                             num_kv_splits=self.num_kv_splits, kv_scale=pool.scale)
        return latent_to_values(layer, out_lat.to(q_nope.dtype))
