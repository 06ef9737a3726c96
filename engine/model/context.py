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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import nn

from engine.distributed.dp_attention import DPGather
from engine.forward_batch import ForwardBatch
from engine.memory.pools import KVPool, ReqToTokenPool
from engine.model.expert_load import ExpertLoad
from engine.model.rope import RotaryEmbedding


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

    def begin_forward(self, fb: ForwardBatch, graph_bs: Optional[int] = None) -> None:
        """Host-side planning once per forward, before any layer runs (graph_bs: a CUDA graph's padded size:
        the layers then keep static shapes and make no host synchronisation, e.g. the MoE token exchange)."""
        self.static_shapes = graph_bs is not None
        if self.expert_load is not None:
            self.expert_load.begin_forward(fb.num_tokens if fb.real_tokens is None else fb.real_tokens)
        self.attn_backend.begin_forward(fb, self, graph_bs)
