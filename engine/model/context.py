"""ForwardContext: what every layer of one forward shares, passed down the forward as `ctx`.

The runner builds one per model (engine/runner.py) and hands it to
`DeepseekForCausalLM.hidden_states` / `MTPLayer`; each decoder layer passes it to its
attention and to its MoE. It holds the KV cache, the request -> token table, the rope
table and the two backends the start-up resolved (engine/model/backends.py): MLA
layers call `ctx.attn_backend`, MoE layers `ctx.moe_backend`; no layer keeps a backend
of its own.

The tensor-parallel group is not here: it is given to the model at construction
(engine/model/deepseek.py), because it also decides which shard of each weight a module
allocates, and each layer that reduces keeps it. What changes per forward under DP
attention, the token counts of every DP group, is here: `dp` (engine/distributed/dp_attention.py,
None without DP attention) gathers the hidden states before each MLP and scatters them after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from engine.distributed.dp_attention import DPGather
    from engine.forward_batch import ForwardBatch
    from engine.memory.pools import KVPool, ReqToTokenPool
    from engine.model.attention import AttentionBackend
    from engine.model.moe import MoEBackend
    from engine.model.rope import RotaryEmbedding


@dataclass
class ForwardContext:
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    rotary: RotaryEmbedding
    attn_backend: AttentionBackend
    moe_backend: MoEBackend
    dp: Optional[DPGather] = None  # DP attention: this forward's gather / scatter (set by the runner)
    expanded_kv: bool = False  # --disable-mla: the pool holds per-head K/V (engine/model/attention_expanded.py)

    def begin_forward(self, fb: ForwardBatch, graph_bs: Optional[int] = None) -> None:
        """Host-side planning once per forward, before any layer runs (graph_bs: a CUDA graph's padded size)."""
        self.attn_backend.begin_forward(fb, self, graph_bs)
