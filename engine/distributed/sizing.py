"""Per-GPU memory under tensor parallelism: weight bytes per rank, KV tokens per rank, fail-fast advice.

Computed from a ModelConfig alone (no model is built), so it runs before any weight is read:

- weights per rank = replicated bytes + split bytes / tp (attention's split part / attn_tp);
  replicated: norms, q_a_proj, kv_a_proj_with_mqa, the MoE router and its bias, the MTP
  eh_proj / norms; split: q_b (or q), kv_b, o_proj, dense MLP, shared and routed experts,
  embed_tokens and lm_head. FP8 linears count 1 byte per weight plus a float32 per 128 x 128
  block; everything else the model dtype. The absorbed MLA buffers (w_kc / w_vc, model dtype,
  split by heads) are real memory too and are counted separately (`absorbed`).
- KV bytes per token = cache layers (decoder layers + the MTP layer when loaded) x
  (kv_lora_rank + qk_rope_head_dim) x KV dtype bytes, the same on every TP rank: MLA's latent is
  shared by all heads, so TP cannot split it and every rank caches every token's latent (the
  reason DP attention exists).
- KV tokens per rank = (GPU bytes x mem_fraction_static - weights per rank) / KV bytes per token.

DP attention replicates attention within a DP rank's smaller attention-TP group: pass
`attn_tp_size` (tp / dp) and the attention part (and the vocab-parallel embedding / lm_head, which
the engine also splits over the attention group) is divided by it instead of tp. Each DP group
has its own KV pool, so the job holds dp x the per-GPU KV tokens (`MemoryPlan.job_kv_tokens`);
plain TP holds one copy (every rank caches every token).

Expert parallel (`ep_size` = tp) cuts the routed experts by whole experts instead of along their
intermediate size: the same bytes per rank (FP8 scale blocks aside, which are whole at both cuts
for DeepSeek-V3), so only the labels change.

`python -m engine.distributed.sizing --table` prints the table of docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Optional

from engine.checkpoint.config import ModelConfig, parse_config
from engine.checkpoint.registry import lookup
from engine.distributed.divisibility import working_tp_sizes
from engine.errors import UsageError

GIB = 2**30
REPL, SPLIT, ATTN, VOCAB = "replicated", "split", "attention", "vocab"


@dataclass(frozen=True)
class WeightBytes:
    """A model's parameter bytes by how TP treats them (totals over the whole model)."""

    replicated: int  # held whole by every rank
    split: int  # divided over the TP ranks (MLP, experts)
    attention: int  # divided over the attention-TP ranks (q_b / q, kv_b, o_proj; embed_tokens, lm_head)
    absorbed: int  # w_kc / w_vc buffers derived from kv_b_proj, divided like attention
    tp_size: int
    attn_tp_size: int

    def params_per_rank(self) -> float:
        """Parameter bytes one rank holds: replicated + split / tp (+ attention / attn_tp)."""
        return self.replicated + self.split / self.tp_size + self.attention / self.attn_tp_size

    def per_rank(self) -> float:
        """Everything the weights occupy on one rank, absorbed buffers included."""
        return self.params_per_rank() + self.absorbed / self.attn_tp_size


class Tally:
    """Parameter bytes by how TP treats them (`bytes[REPL / SPLIT / ATTN]`), added up part by part (also by
    engine/distributed/step_floor.py, for the weights one decode step reads)."""

    def __init__(self, dtype_bytes: int, fp8_block: Optional[tuple[int, int]]):
        self.dtype_bytes, self.fp8_block = dtype_bytes, fp8_block
        self.bytes = {REPL: 0, SPLIT: 0, ATTN: 0}  # (vocab rows are split like attention: ATTN)
        self.absorbed = 0

    def dense(self, numel: int, where: str, itemsize: Optional[int] = None) -> None:
        self.bytes[where] += numel * (itemsize or self.dtype_bytes)

    def linear(self, out_f: int, in_f: int, where: str, count: float = 1, fp8: bool = True) -> None:
        """`count` weights [out_f, in_f]: block-FP8 (+ float32 scales) when the model keeps FP8 weights."""
        if fp8 and self.fp8_block:
            bn, bk = self.fp8_block
            per = out_f * in_f + math.ceil(out_f / bn) * math.ceil(in_f / bk) * 4
        else:
            per = out_f * in_f * self.dtype_bytes
        self.bytes[where] += count * per

    def mlp(self, hidden: int, inter: int) -> None:
        self.linear(inter, hidden, SPLIT, count=2)  # gate, up
        self.linear(hidden, inter, SPLIT)  # down

    def decoder_layer(self, cfg: ModelConfig, moe: bool, experts: Optional[float] = None) -> None:
        """One decoder layer; an MoE layer with every routed expert, or `experts` of them (a decode step's
        expected count)."""
        self.dense(2 * cfg.hidden_size, REPL)  # input / post-attention norms
        self.attention(cfg)
        self.absorbed += cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * \
            self.dtype_bytes
        if moe:
            self.moe(cfg, cfg.n_routed_experts if experts is None else experts)
        else:
            self.mlp(cfg.hidden_size, cfg.intermediate_size)

    def attention(self, cfg: ModelConfig) -> None:
        """MLA's projections and their norms (q_a / kv_a replicated; q_b or q, kv_b, o_proj over attention TP)."""
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

    def moe(self, cfg: ModelConfig, experts: float) -> None:
        """An MoE layer's router (and its bias), `experts` routed experts (all of them, or the expected number
        a decode step touches) and the shared experts."""
        h, e, n = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.dense(e * h, REPL)  # router
        if cfg.topk_method == "noaux_tc":
            self.dense(e, REPL, itemsize=4)
        self.linear(2 * n, h, SPLIT, count=experts)  # w13
        self.linear(h, n, SPLIT, count=experts)  # w2
        if cfg.n_shared_experts:
            self.mlp(h, cfg.n_shared_experts * n)


def weight_bytes(cfg: ModelConfig, tp_size: int, dtype_bytes: int = 2, fp8_block: Optional[tuple[int, int]] = None,
                 include_mtp: bool = True, attn_tp_size: Optional[int] = None) -> WeightBytes:
    """Parameter bytes of `cfg` as the engine builds it (model dtype `dtype_bytes`; `fp8_block` when the
    linear weights are kept block-FP8), split by how TP `tp_size` treats them."""
    t = Tally(dtype_bytes, fp8_block)
    h = cfg.hidden_size
    t.dense(cfg.vocab_size * h, ATTN)  # embed_tokens (vocab rows over the attention group)
    if not cfg.tie_word_embeddings:
        t.dense(cfg.vocab_size * h, ATTN)  # lm_head
    t.dense(h, REPL)  # final norm
    for i in range(cfg.num_hidden_layers):
        t.decoder_layer(cfg, cfg.is_moe_layer(i))
    if include_mtp and cfg.num_nextn_predict_layers:
        t.dense(3 * h, REPL)  # enorm, hnorm, shared_head norm
        t.linear(h, 2 * h, REPL, fp8=False)  # eh_proj (kept in the model dtype)
        t.decoder_layer(cfg, cfg.is_moe_layer(cfg.num_hidden_layers))
    return WeightBytes(t.bytes[REPL], t.bytes[SPLIT], t.bytes[ATTN], t.absorbed, tp_size, attn_tp_size or tp_size)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int = 2, include_mtp: bool = True) -> int:
    """Latent KV cache bytes per token on every TP rank (all cache layers)."""
    layers = cfg.num_hidden_layers + (1 if include_mtp and cfg.num_nextn_predict_layers else 0)
    return layers * cfg.kv_cache_dim * kv_dtype_bytes


# ---------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Layout:
    """The GPUs and dtypes one plan is for."""

    tp_size: int
    gpu_bytes: float
    mem_fraction_static: float = 0.85
    dtype_bytes: int = 2  # model dtype (bf16)
    fp8_block: Optional[tuple[int, int]] = None  # linear weights kept block-FP8
    kv_dtype_bytes: int = 2  # 2: bf16 KV cache, 1: fp8
    include_mtp: bool = True
    gpus_per_node: int = 8
    attn_tp_size: Optional[int] = None  # DP attention: tp / dp
    ep_size: int = 1  # expert parallel (= tp): the same bytes per rank, cut by whole experts

    @property
    def dp_size(self) -> int:
        return self.tp_size // (self.attn_tp_size or self.tp_size)


@dataclass(frozen=True)
class MemoryPlan:
    layout: Layout
    weights: WeightBytes
    kv_per_token: int

    @property
    def budget(self) -> float:
        return self.layout.gpu_bytes * self.layout.mem_fraction_static

    @property
    def weights_per_rank(self) -> float:
        return self.weights.per_rank()

    @property
    def kv_tokens(self) -> int:
        """KV tokens one GPU holds."""
        return max(0, int((self.budget - self.weights_per_rank) // self.kv_per_token))

    @property
    def job_kv_tokens(self) -> int:
        """Distinct KV tokens of the whole job: one pool per DP group (plain TP: one, duplicated on every rank)."""
        return self.kv_tokens * self.layout.dp_size


def plan_memory(cfg: ModelConfig, layout: Layout) -> MemoryPlan:
    w = weight_bytes(cfg, layout.tp_size, layout.dtype_bytes, layout.fp8_block, layout.include_mtp,
                     layout.attn_tp_size)
    return MemoryPlan(layout, w, kv_bytes_per_token(cfg, layout.kv_dtype_bytes, layout.include_mtp))


def _fits(cfg: ModelConfig, layout: Layout, min_kv_tokens: int) -> bool:
    return plan_memory(cfg, layout).kv_tokens >= min_kv_tokens


def suggestions(cfg: ModelConfig, layout: Layout, min_kv_tokens: int) -> list[str]:
    """Flag changes that would make the model fit, most direct first."""
    out = []
    for tp in working_tp_sizes(cfg, layout.fp8_block):
        bigger = replace(layout, tp_size=tp, attn_tp_size=None)
        if tp > layout.tp_size and _fits(cfg, bigger, min_kv_tokens):
            nodes = math.ceil(tp / layout.gpus_per_node)
            out.append(f"--tp {tp}" + (f" --nnodes {nodes}" if nodes > 1 else ""))
            break
    if layout.fp8_block is None and layout.dtype_bytes >= 2:
        fp8 = replace(layout, fp8_block=(128, 128))
        if _fits(cfg, fp8, min_kv_tokens):
            out.append("--quantization fp8" if cfg.fp8 is None else "FP8 weights (drop --quantization none)")
    if layout.kv_dtype_bytes >= 2 and _fits(cfg, replace(layout, kv_dtype_bytes=1), min_kv_tokens):
        out.append("--kv-cache-dtype fp8_e4m3")
    return out


def check_fits(cfg: ModelConfig, layout: Layout, min_kv_tokens: int = 1024, name: str = "the model") -> MemoryPlan:
    """The plan when weights + `min_kv_tokens` of KV fit in every rank's budget; else UsageError saying
    what it needs and which flags would make it fit."""
    plan = plan_memory(cfg, layout)
    if plan.kv_tokens >= min_kv_tokens:
        return plan
    kv_need = min_kv_tokens * plan.kv_per_token
    fix = suggestions(cfg, layout, min_kv_tokens)
    advice = ("try " + " or ".join(fix)) if fix else \
        "no TP size or dtype on these GPUs fits it: use GPUs with more memory"
    raise UsageError(
        f"{name} needs {plan.weights_per_rank / GIB:.1f} GiB of weights per GPU at --tp {layout.tp_size} plus "
        f"{kv_need / GIB:.2f} GiB for {min_kv_tokens} KV tokens, but --mem-fraction-static "
        f"{layout.mem_fraction_static} of a {layout.gpu_bytes / GIB:.0f} GiB GPU is {plan.budget / GIB:.1f} GiB: "
        f"{advice}")


# ---------------------------------------------------------------------------- the docs table

TABLE_SETUPS = (
    # (label, tp, gpu GiB, gpus per node, dp (DP attention), ep)
    ("TP 8 on 8 x H200 (141 GB)", 8, 141, 8, 1, 1),
    ("TP 8 + DP attention 8 on 8 x H200", 8, 141, 8, 8, 1),
    ("TP 8 + EP 8 on 8 x H200", 8, 141, 8, 1, 8),
    ("TP 16 on 2 x 8 x H100 (80 GB)", 16, 80, 8, 1, 1),
    ("TP 8 on 8 x H100 (80 GB)", 8, 80, 8, 1, 1),
)


def _kv_cell(cfg: ModelConfig, layout: Layout) -> str:
    """"per GPU / per job" KV tokens, or why it does not fit."""
    try:
        plan = check_fits(cfg, layout)
    except UsageError:
        fix = suggestions(cfg, layout, 1024)
        return "does not fit" + (f" (try {fix[0]})" if fix else "")
    return f"{plan.kv_tokens:,} / {plan.job_kv_tokens:,}"


def table(cfg: ModelConfig, mem_fraction_static: float = 0.85) -> str:
    """Markdown table: per-GPU weight GiB and KV tokens per GPU / per job (bf16 / fp8 KV) for each setup,
    FP8 weights."""
    block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else (128, 128)
    rows = ["| setup | weights / GPU (GiB) | of which replicated | KV bytes / token | KV tokens per GPU / per job, "
            "bf16 KV | KV tokens per GPU / per job, fp8 KV |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, tp, gib, per_node, dp, ep in TABLE_SETUPS:
        layouts = [Layout(tp, gib * GIB, mem_fraction_static, 2, block, kv_bytes, True, per_node,
                          attn_tp_size=tp // dp, ep_size=ep) for kv_bytes in (2, 1)]
        plan = plan_memory(cfg, layouts[0])
        kv_cells = (f"{kv_bytes_per_token(cfg, b):,} ({'bf16' if b == 2 else 'fp8'})" for b in (2, 1))
        rows.append(f"| {label} | {plan.weights_per_rank / GIB:.1f} | {plan.weights.replicated / GIB:.2f} "
                    f"| {' / '.join(kv_cells)} | {_kv_cell(cfg, layouts[0])} | {_kv_cell(cfg, layouts[1])} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.sizing", description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="print the per-GPU table of docs/parallelism.md")
    p.add_argument("--model", default="deepseek-v3", help="a model alias with a shipped config (default deepseek-v3)")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    args = p.parse_args(argv)
    entry = lookup(args.model)
    if entry is None:
        raise SystemExit(f"unknown model alias {args.model!r}")
    cfg = parse_config(entry.config_dict())
    print(f"{args.model}, FP8 weights (bf16 embeddings / norms / router / absorbed w_kc, w_vc), MTP layer loaded, "
          f"--mem-fraction-static {args.mem_fraction_static}, GPU memory in GiB:\n")
    print(table(cfg, args.mem_fraction_static))


if __name__ == "__main__":
    main()
