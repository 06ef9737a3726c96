"""Attention without MLA weight absorption (--disable-mla): per-head K/V in the KV cache.

This is SGLang's `--disable-mla` ablation: MLA run as ordinary multi-head attention, so
`dsctl bench ablation` can measure what weight absorption buys. Each new token's latent
is expanded with kv_b_proj when it is written: k = [k_nope | k_pe] per head (the rotated
k_pe is shared by the heads), v per head. A pool row is [local heads, qk_head_dim +
v_head_dim] (`kv_row_dim` in engine/memory/pools.py); W_UK / W_UV are never folded into
the query or the output. Under TP a rank caches only its own heads.

Every mode is the same computation: the batch's new tokens (q, and their fresh k / v)
attend to their request's cached prefix read from the pool and, causally, to each other.
A decode step is one new token per request.

Backends (engine/model/kernel_registry.py builds these when KernelSetup.expanded_kv):
- `TorchExpandedAttention`: the reference, one request at a time, float32 softmax.
- `TritonExpandedAttention`: decode runs kernels/mha_decode.py, a paged kernel that reads
  each request's per-head K/V straight from the pool through the req->token table (fixed
  shapes, lengths on the device: CUDA graphs and torch.compile work as with MLA). Prefill
  (extend, target-verify, draft-extend) runs the expanded prefill attention
  (engine/model/prefill_attention.py: kernels/mla_extend.py's packed extend kernel, or FlashInfer's
  batch prefill) over the new tokens' K/V and each request's cached prefix, gathered from the pool
  first (requests grouped so a group's gather stays under PREFIX_GATHER_BYTES).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.forward_batch import ForwardBatch
from engine.model.attention import MLA
from engine.model.context import ForwardContext
from engine.model.prefill_attention import PrefillGroup, PrefillPlan, TritonPrefill
from kernels.mha_decode import mha_decode

PREFIX_GATHER_BYTES = 1 << 30  # cached K/V one Triton launch gathers (a lone request may exceed it)


class ExpandedAttentionBackend:
    """What both --disable-mla backends share: MLA.forward calls `expand_and_attend` (no import inside a
    forward that torch.compile may trace); each backend implements `begin_forward` and `attend`."""

    def expand_and_attend(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch,
                          ctx: ForwardContext) -> torch.Tensor:
        """Write the new tokens' expanded K/V into the pool, then attend; output [T, H, v]."""
        t, h = q_nope.shape[0], layer.num_heads
        k_nope, v = layer.expand_latent(c_kv)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(t, h, -1)), dim=-1)
        ctx.kv_pool.write(layer.layer_id, fb.out_cache_loc, torch.cat((k, v), dim=-1).reshape(t, -1))
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.attend(layer, q, k, v.contiguous(), fb, ctx)

    def attend(self, layer: MLA, q, k, v, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """q, k [T, H, qk] and v [T, H, v] of the new tokens (already in the pool) -> output [T, H, v]."""
        raise NotImplementedError


def read_kv(layer: MLA, ctx: ForwardContext, slots: torch.Tensor, dtype: torch.dtype):
    """Cached K [n, H, qk] and V [n, H, v] of `slots` (views of one gathered tensor)."""
    rows = ctx.kv_pool.read(layer.layer_id, slots, dtype).view(-1, layer.num_heads,
                                                                layer.nope + layer.rope_dim + layer.v_dim)
    qk = layer.nope + layer.rope_dim
    return rows[..., :qk], rows[..., qk:]


class TorchExpandedAttention(ExpandedAttentionBackend):
    """Reference multi-head attention over the expanded cache: one request at a time, float32 softmax."""

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        pass

    def attend(self, layer: MLA, q, k, v, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_dim)
        start = 0
        for i, (n, prefix) in enumerate(zip(fb.extend_lens_cpu, fb.prefix_lens_cpu)):
            if n == 0:
                continue
            row = int(fb.req_pool_indices[i])
            k_pre, v_pre = read_kv(layer, ctx, ctx.req_to_token.slots(row, prefix), torch.float32)
            keys = torch.cat((k_pre, k[start:start + n].float()))
            vals = torch.cat((v_pre, v[start:start + n].float()))
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * layer.scale
            q_pos = torch.arange(prefix, prefix + n, device=scores.device)
            k_pos = torch.arange(prefix + n, device=scores.device)
            scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            out[start:start + n] = torch.einsum("hqk,khv->qhv", scores.softmax(-1), vals).to(out.dtype)
            start += n
        return out


class TritonExpandedAttention(ExpandedAttentionBackend):
    """kernels/mla_extend.py over gathered per-request K/V (see the module docstring)."""

    def __init__(self, token_bytes: int, prefill=None):
        """token_bytes: one cached token's K/V in one layer (heads x (qk + v) x element size); prefill: the
        expanded prefill attention (engine/model/prefill_attention.py; default the Triton kernel)."""
        self.prefill = prefill or TritonPrefill()
        self.prefix_token_budget = max(1, PREFIX_GATHER_BYTES // (token_bytes * self.prefill.prefix_copies))
        self.groups: list[tuple[int, int, int, int]] = []
        self.prefill_plan: Optional[PrefillPlan] = None

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        """Extend batches: group consecutive requests (r0, r1, t0, t1) so each group's gathered prefix fits
        the budget (decode needs no host planning)."""
        self.groups = []
        if fb.mode.is_decode:
            return
        r, t, n = 0, 0, len(fb.extend_lens_cpu)
        while r < n:
            r1, t1, prefix = r, t, 0
            while r1 < n and (r1 == r or prefix + fb.prefix_lens_cpu[r1] <= self.prefix_token_budget):
                prefix += fb.prefix_lens_cpu[r1]
                t1 += fb.extend_lens_cpu[r1]
                r1 += 1
            self.groups.append((r, r1, t, t1))
            r, t = r1, t1
        self.prefill_plan = self.prefill.plan(fb, [PrefillGroup(r0, r1, max(fb.extend_lens_cpu[r0:r1]))
                                                   for r0, r1, _, _ in self.groups])

    @torch.compiler.disable
    def attend(self, layer: MLA, q, k, v, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        if fb.mode.is_decode:  # the new token is in the pool already (expand_and_attend wrote it)
            pool = ctx.kv_pool
            return mha_decode(q, pool.buffer[layer.layer_id], ctx.req_to_token.table, fb.req_pool_indices,
                              fb.seq_lens, layer.v_dim, layer.scale, kv_scale=pool.scale)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_dim)
        table = ctx.req_to_token.table
        rows = fb.req_pool_indices.tolist() if self.groups else []
        for group, (r0, r1, t0, t1) in enumerate(self.groups):
            parts = [table[rows[i], :fb.prefix_lens_cpu[i]] for i in range(r0, r1) if fb.prefix_lens_cpu[i]]
            if parts:
                k_pre, v_pre = read_kv(layer, ctx, torch.cat(parts).to(torch.int64), q.dtype)
            else:
                k_pre = q.new_empty(0, layer.num_heads, q.shape[-1])
                v_pre = q.new_empty(0, layer.num_heads, layer.v_dim)
            self.prefill.attend(self.prefill_plan, group, q[t0:t1], k[t0:t1], v[t0:t1], k_pre, v_pre, layer.scale, out[t0:t1])
        return out
