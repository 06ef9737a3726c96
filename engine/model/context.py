"""ForwardContext: what every layer of one forward shares, passed down the forward as `ctx`; and the
two backend protocols it holds.

The runner builds one per model (engine/runner/model_runner.py) and hands it to
`DeepseekForCausalLM.hidden_states` / `MTPLayer`; each decoder layer passes it to its
attention and to its MoE. It holds the KV cache, the request -> token table, the rope
table and the two backend objects the start-up resolved (engine/model/kernel_registry.py): MLA
layers call `ctx.attn_backend`, MoE layers `ctx.moe_backend`; no layer keeps a backend
of its own. The per-call kernels (block-FP8 GEMM, RMSNorm, MoE gate, all-reduce) are not here:
each module is given them at construction (engine/model/kernel_set.py).

The backend protocols live here, not next to MLA / MoE, so that the imports point one way:
attention.py and moe.py import this module, never the reverse.

The tensor-parallel group is not here: it is given to the model at construction
(engine/model/deepseek.py), because it also decides which shard of each weight a module
allocates, and each layer that reduces keeps it. What changes per forward under DP
attention, the token counts of every DP group, is here: `dp` (engine/distributed/dp_attention.py,
None without DP attention) gathers the hidden states before each MLP and scatters them after. So are the
routing counts every MoE layer adds to (`expert_load`, engine/model/expert_load.py; None unless
--record-expert-load), told each forward's real row count by `begin_forward`.

Padding rows (`pad_rows`): a padded forward (a CUDA graph's, or the piecewise graphs' token bucket) routes its
padding rows like real ones; under DP attention every group pads to the same width, so at small batches most
of the MoE's rows are padding (an idle group's all of them), and a decode batch of 5 replays the graph of 8.
`mask_padding` marks them in a static device buffer the captured graphs read (`pad_buffer`, reserved before any
capture), and the MoE layers' router gives them no expert (ids -1: no expert work, no expert weights read for
them; the gate kernel reads the marks in its own launch). The runner marks before every decode-graph and piecewise
replay (and capture: no padding) and `begin_forward` clears them, so every forward starts with one or the other;
marks equal to the buffer's last are not written again, so steady batch sizes cost nothing per step. A forward
split by two-batch overlap is not marked (its micro-batches' contexts carry no marks): its padding rows are routed
as before.

Two-batch overlap (`two_batch`, engine/model/two_batch.py; None when off): `begin_forward` decides whether the
forward runs as two micro-batches and, if so, plans each in a context of its own (`micro`: its batch, its
attention planning, its DP gather, its view of the routing counts). The two contexts are made once and kept, as
CUDA graphs captured with them read their tensors at every replay.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Optional, Protocol, Sequence

import torch
from torch import nn

from engine.distributed.dp_attention import DPGather
from engine.forward_batch import ForwardBatch, tensor_to_device
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.model.expert_load import ExpertLoad
from engine.model.rope import RotaryEmbedding
from engine.model.two_batch import TwoBatchOverlap, requests_before, split_batch, split_point


class AttentionBackend(Protocol):
    """MLA attention over the KV cache (layer: the `MLA` module asking)."""

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        """Host-side set-up once per forward, before any layer runs (graph_bs: the CUDA graph's padded size)."""

    def extend(self, layer: nn.Module, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch,
               ctx: ForwardContext) -> torch.Tensor:
        """New tokens' attention output [T, H, v]."""

    def decode(self, layer: nn.Module, q_nope, q_pe, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """One token per request; output [B, H, v]."""


class MoEBackend(Protocol):
    """The routed experts of a MoE layer (moe: the `MoE` module asking, holding the expert weights)."""

    def experts(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over the chosen experts of weight * expert(x): [T, hidden]."""


@dataclass
class MicroBatch:
    """One of a two-batch-overlap forward's micro-batches: its batch and the context it runs in."""

    fb: ForwardBatch
    ctx: ForwardContext


@dataclass
class ForwardContext:
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    rotary: RotaryEmbedding
    attn_backend: AttentionBackend
    moe_backend: MoEBackend
    dp: Optional[DPGather] = None  # DP attention: this forward's gather / scatter (set by the runner)
    expanded_kv: bool = False  # --disable-mla: the pool holds per-head K/V (engine/model/attention_expanded.py)
    static_shapes: bool = False  # this forward is a CUDA graph's (captured, or its padded batch run eagerly)
    expert_load: Optional[ExpertLoad] = None  # --record-expert-load: the MoE layers' routing counts
    two_batch: Optional[TwoBatchOverlap] = None  # --enable-two-batch-overlap: when a forward splits
    micro: Optional[tuple[MicroBatch, MicroBatch]] = None  # this forward's micro-batches (None: not split)
    halves: Optional[tuple[ForwardContext, ForwardContext]] = field(default=None, repr=False)
    pad_buffer: Optional[torch.Tensor] = field(default=None, repr=False)  # static bool rows (`reserve_padding`)
    pad_rows: Optional[torch.Tensor] = field(default=None, repr=False)  # this forward's padding rows (None: none)
    pad_marked: Optional[tuple] = field(default=None, repr=False)  # (real counts, width) the buffer holds

    def reserve_padding(self, rows: int, device: torch.device, captured: bool = False) -> None:
        """The static buffer of `mask_padding`, for padded forwards of up to `rows` MoE input rows. Graphs keep
        reading the buffer they were captured with, so it may grow only while none is (`captured`: some are)."""
        if self.pad_buffer is not None and self.pad_buffer.shape[0] >= rows:
            return
        if captured and self.pad_buffer is not None:
            raise RuntimeError("the padding mask must be reserved at its largest size before any graph is captured")
        self.pad_buffer = torch.zeros(rows, dtype=torch.bool, device=device)
        self.pad_marked = None

    def mask_padding(self, real: Sequence[int], width: int) -> None:
        """This forward's MoE input is len(real) blocks of `width` rows (the DP groups' under DP attention, in group
        order; else one), of which block g's first real[g] are real tokens: the rest are marked as padding, whose
        routed experts the MoE layers drop. Called after `begin_forward` (which clears the marks) and before
        the forward's graphs are captured or replayed."""
        rows = self.pad_buffer[: len(real) * width]
        key = (tuple(real), width)
        if key != self.pad_marked:
            counts = tensor_to_device(torch.tensor(real, dtype=torch.int32), rows.device)
            pad = torch.arange(width, dtype=torch.int32, device=rows.device)[None, :] >= counts[:, None]
            rows.copy_(pad.view(-1))
            self.pad_marked = key
        self.pad_rows = rows

    def padding_marks(self, rows: int) -> Optional[torch.Tensor]:
        """This forward's padding marks (None: not a padded forward), which must cover `rows` MoE input rows (every
        DP group's block); marks of another size were left by an earlier forward: refused, not misapplied."""
        if self.pad_rows is not None and self.pad_rows.shape[0] != rows:
            raise RuntimeError(f"padding marks of {self.pad_rows.shape[0]} rows for a MoE input of {rows}: a forward "
                               "ran without marking (mask_padding) or clearing (begin_forward) them")
        return self.pad_rows

    def begin_forward(self, fb: ForwardBatch, graph_bs: Optional[int] = None) -> None:
        """Host-side planning once per forward, before any layer runs (graph_bs: a CUDA graph's padded size:
        the layers then keep static shapes and make no host synchronisation, e.g. the MoE token exchange)."""
        self.static_shapes = graph_bs is not None
        self.pad_rows = None
        if self.expert_load is not None:
            self.expert_load.begin_forward(fb.num_tokens if fb.real_tokens is None else fb.real_tokens)
        self.micro = self._plan_micro_batches(fb)
        if self.micro is None and fb.num_tokens:  # a batch of no tokens runs no attention
            self.attn_backend.begin_forward(fb, self, graph_bs)

    def _plan_micro_batches(self, fb: ForwardBatch) -> Optional[tuple[MicroBatch, MicroBatch]]:
        """Under two-batch overlap, the forward's two micro-batches, planned (None: it runs whole). Every rank
        decides alike: from the agreed counts under DP attention, else from the batch every rank holds."""
        if self.two_batch is None or fb.spec_hidden is not None:  # the MTP layer's forwards run whole
            return None
        if self.dp is not None:
            if self.dp.splits is None or not self.two_batch.splits(sum(self.dp.splits), self.dp.total):
                return None
            gathers = self.dp.halves()
            tokens = self.dp.splits[self.dp.group.dp_rank]
            requests = requests_before(fb, tokens)
        else:
            gathers = (None, None)
            requests, tokens = split_point(fb)
            if not self.two_batch.splits(tokens, fb.num_tokens):
                return None
        if self.halves is None:
            self.halves = (self._half(), self._half())
        micro = tuple(MicroBatch(part, half) for part, half in zip(split_batch(fb, requests, tokens), self.halves))
        for m, gather in zip(micro, gathers):
            m.ctx.dp = gather
            graph_bs = m.fb.num_tokens if self.static_shapes else None
            m.ctx.begin_forward(m.fb, graph_bs)
        return micro

    def _half(self) -> ForwardContext:
        """A micro-batch's context: this one's pools and backends, its own attention planning and real-row count."""
        load = self.expert_load.view() if self.expert_load is not None else None
        return replace(self, attn_backend=copy.copy(self.attn_backend), expert_load=load, two_batch=None, micro=None,
                       halves=None, pad_rows=None, pad_buffer=None, pad_marked=None)
