"""Weight bytes of a DeepSeek config, added up part by part and kept by how tensor parallelism treats them.

`Tally.bytes` has three keys:

- `REPL`: held whole by every rank (norms, q_a / kv_a, the MoE router and its bias, the MTP eh_proj);
- `SPLIT`: divided over all TP ranks (dense MLP, shared experts, routed experts: each expert along its
  intermediate size, or whole experts under EP, the same bytes);
- `ATTN`: divided over the attention group, tp / dp ranks under DP attention (q_b or q, kv_b, o_proj,
  and the vocab rows of embed_tokens / lm_head).

`Tally.absorbed` holds the w_kc / w_vc buffers MLA derives from kv_b_proj (model dtype, divided like
`ATTN`). Linear weights count 1 byte plus a float32 per `fp8_block` block when the tally has one, else the
model dtype's bytes; other weights (embeddings, norms) always the model dtype, the router float32.

Users: the memory plan (engine/memory/plan.py) tallies each part of one rank's weights with it, and
engine/distributed/step_floor.py the weights a decode step reads. No torch; tests/test_layering.py places
this module with engine/distributed/ so that step_floor.py may import it.
"""

from __future__ import annotations

import math
from typing import Optional

from engine.checkpoint.config import ModelConfig
from engine.memory.formats import quantization_for

REPL, SPLIT, ATTN = "replicated", "split", "attention"


class Tally:
    """Parameter bytes by how TP treats them (`bytes[REPL / SPLIT / ATTN]`) and the absorbed buffers' bytes."""

    def __init__(self, dtype_bytes: int, fp8_block: Optional[tuple[int, int]]):
        self.dtype_bytes, self.fp8_block = dtype_bytes, fp8_block
        self.bytes = {REPL: 0, SPLIT: 0, ATTN: 0}
        self.absorbed = 0

    def add(self, nbytes: float, where: str) -> None:
        """Bytes counted elsewhere (e.g. routed experts in a format of engine/memory/formats.py)."""
        self.bytes[where] += nbytes

    def dense(self, numel: int, where: str, itemsize: Optional[int] = None) -> None:
        self.bytes[where] += numel * (itemsize or self.dtype_bytes)

    def linear(self, out_f: int, in_f: int, where: str, count: float = 1, fp8: bool = True) -> None:
        """`count` weights [out_f, in_f]: block-FP8 (+ float32 scales) when the tally keeps FP8 weights."""
        if fp8 and self.fp8_block:
            bn, bk = self.fp8_block
            per = out_f * in_f + math.ceil(out_f / bn) * math.ceil(in_f / bk) * 4
        else:
            per = out_f * in_f * self.dtype_bytes
        self.bytes[where] += count * per

    def mlp(self, hidden: int, inter: int, where: str = SPLIT) -> None:
        self.linear(inter, hidden, where, count=2)  # gate, up
        self.linear(hidden, inter, where)  # down

    def attention(self, cfg: ModelConfig) -> None:
        """MLA's projections and their norms (q_a / kv_a whole; q_b or q, kv_b, o_proj over the attention group)
        and the absorbed w_kc / w_vc."""
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank:
            self.linear(cfg.q_lora_rank, h, REPL)
            self.dense(cfg.q_lora_rank, REPL)
            self.linear(heads * cfg.qk_head_dim, cfg.q_lora_rank, ATTN)
        else:
            self.linear(heads * cfg.qk_head_dim, h, ATTN)
        self.linear(cfg.kv_cache_dim, h, REPL)
        self.dense(cfg.kv_lora_rank, REPL)
        self.linear(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, ATTN)
        self.linear(h, heads * cfg.v_head_dim, ATTN)
        self.absorbed += heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * self.dtype_bytes

    def router(self, cfg: ModelConfig) -> None:
        """An MoE layer's gate (float32: the router's logits are float32) and, under noaux_tc, its float32 correction
        bias: whole on every rank."""
        self.dense(cfg.n_routed_experts * cfg.hidden_size, REPL, itemsize=4)
        if cfg.topk_method == "noaux_tc":
            self.dense(cfg.n_routed_experts, REPL, itemsize=4)

    def shared_experts(self, cfg: ModelConfig, where: str = SPLIT) -> None:
        if cfg.n_shared_experts:
            self.mlp(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size, where)

    def moe(self, cfg: ModelConfig, experts: float) -> None:
        """An MoE layer: router, `experts` routed experts (all of them, or the expected number a decode step
        touches) stored like the linear layers (INT4 under `cfg.experts_int4_group`), and the shared experts."""
        h, n = cfg.hidden_size, cfg.moe_intermediate_size
        self.router(cfg)
        if cfg.experts_int4_group:  # W4AFP8: the formats table's INT4 experts, as the memory plan counts them
            fmt = quantization_for("w4afp8", int4_group=cfg.experts_int4_group).experts
            self.add(experts * (fmt.nbytes(2 * n, h) + fmt.nbytes(h, n)), SPLIT)
        else:
            self.linear(2 * n, h, SPLIT, count=experts)  # w13
            self.linear(h, n, SPLIT, count=experts)  # w2
        self.shared_experts(cfg)

    def decoder_layer(self, cfg: ModelConfig, moe: bool, experts: Optional[float] = None) -> None:
        """One decoder layer; an MoE layer with every routed expert, or `experts` of them."""
        self.dense(2 * cfg.hidden_size, REPL)  # input / post-attention norms
        self.attention(cfg)
        if moe:
            self.moe(cfg, cfg.n_routed_experts if experts is None else experts)
        else:
            self.mlp(cfg.hidden_size, cfg.intermediate_size)
