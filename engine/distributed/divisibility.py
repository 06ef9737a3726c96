"""Whether a TP size splits a model's weights cleanly: heads, vocab, intermediate sizes, experts and
FP8 blocks (`check_model_divisible`, `working_tp_sizes`).

Every check raises `UsageError` with a one-line message that says how to fix it, before any weight
is read.

FP8 block checkpoints and TP (the decision)
-------------------------------------------
A TP split cuts a weight along its rows (q_b / kv_b / gate / up) or columns (o_proj / down)
into per-rank slices of `full / tp`. Block-FP8 weights carry one float32 scale per 128 x 128
tile, so a slice either starts on a block boundary (it takes whole scale rows/cols) or sits
inside one block (it takes that block's scale). Both dequantise exactly; re-quantising per
rank would not be exact and is never done. What is rejected:

- a slice that straddles a block boundary (e.g. 192 rows per rank with 128-row blocks): its
  local row r would need scale row (start + r) // 128 - start // 128, which the kernels,
  indexing scales by r // 128, do not compute;
- routed-expert w13 slices that are not a whole number of blocks: w13 stacks the gate rows and
  then the up rows, and the fused MoE kernel finds the up half's scales at
  (row + N_local) // 128, so N_local (= moe_intermediate_size / tp) must be a multiple of the
  block. tiny-fp8 at TP 2 (64 rows per rank) is such a case.

Dense linears whose per-rank slice is smaller than a block but inside it are accepted: the
block GEMM (kernels/fp8.py) indexes weight scales by row // GROUP_N and masks the K tail, so
a [64, K] weight with one scale row, or a [N, 64] weight with one scale column, is exact.
(Along K the activations are then quantised in 1 x 64 groups instead of 1 x 128: the weights
are exact, the W8A8 activation rounding differs slightly from TP 1.)

These rules apply only when FP8 weights stay FP8 (`fp8_block` given, the CUDA W8A8 path).
When the loader dequantises them (`fp8_block=None`, e.g. on CPU), any divisible split is
exact: engine.weights.sharding dequantises a slice with its enclosing blocks' scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.checkpoint.config import ModelConfig
from engine.errors import UsageError


@dataclass(frozen=True)
class SplitDim:
    """One dimension that TP cuts: `full` elements split into tp slices."""

    what: str  # shown to the user: tensor name and dimension
    full: int
    block: Optional[int] = None  # FP8 block along this dim (None: not FP8, or dequantised)
    whole_blocks: bool = False  # FP8 slices must be whole blocks (routed-expert w13)


def attention_dims(cfg: ModelConfig, bn: Optional[int] = None, bk: Optional[int] = None) -> list[SplitDim]:
    """The dimensions the attention TP split cuts (heads, vocab, q / kv_b rows, o_proj columns); bn / bk:
    the FP8 checkpoint block along rows / columns (None: not FP8 or dequantised)."""
    heads = cfg.num_attention_heads
    q = "q_b_proj" if cfg.q_lora_rank else "q_proj"
    return [SplitDim("num_attention_heads (MLA is split by heads)", heads),
            SplitDim("vocab_size (embed_tokens / lm_head rows; vocab padding is not implemented)", cfg.vocab_size),
            SplitDim(f"self_attn.{q} rows (heads x {cfg.qk_head_dim})", heads * cfg.qk_head_dim, bn),
            SplitDim(f"self_attn.kv_b_proj rows (heads x {cfg.qk_nope_head_dim + cfg.v_head_dim})",
                     heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bn),
            SplitDim(f"self_attn.o_proj columns (heads x {cfg.v_head_dim})", heads * cfg.v_head_dim, bk)]


def split_dims(cfg: ModelConfig, fp8_block: Optional[tuple[int, int]] = None, ep: bool = False) -> list[SplitDim]:
    """Every dimension TP splits in this model, with the FP8 block constraints that apply.

    `ep`: expert parallel (--ep-size = --tp): the routed experts are split by whole experts (each
    rank keeps the full moe_intermediate_size of its n_routed_experts / tp experts) instead of
    along their intermediate size, so only the expert count must divide.

    `fp8_block` is the block of weights kept FP8 (None when they are dequantised). Slices of an
    FP8 checkpoint must not straddle blocks; weights quantised at load (--quantization fp8 on a
    bf16 checkpoint) are quantised per rank, so only the w13 whole-block rule applies to them.
    """
    bn, bk = fp8_block if fp8_block and cfg.fp8 is not None else (None, None)
    return attention_dims(cfg, bn, bk) + mlp_dims(cfg, fp8_block, ep)


def mlp_dims(cfg: ModelConfig, fp8_block: Optional[tuple[int, int]] = None, ep: bool = False) -> list[SplitDim]:
    """The dimensions of the dense MLPs and the MoE that TP (or EP, for the routed experts) splits."""
    bn, bk = fp8_block if fp8_block else (None, None)
    bn_ckpt, bk_ckpt = (None, None) if cfg.fp8 is None else (bn, bk)
    out: list[SplitDim] = []
    layers = range(cfg.num_hidden_layers)
    if any(not cfg.is_moe_layer(i) for i in layers):
        inter = cfg.intermediate_size
        out += [SplitDim("intermediate_size (dense mlp.gate_proj / up_proj rows)", inter, bn_ckpt),
                SplitDim("intermediate_size (dense mlp.down_proj columns)", inter, bk_ckpt)]
    if cfg.n_routed_experts and any(cfg.is_moe_layer(i) for i in layers):
        n = cfg.moe_intermediate_size
        if ep:
            out.append(SplitDim("n_routed_experts (--ep-size: whole experts per rank)", cfg.n_routed_experts))
        else:
            out += [SplitDim("moe_intermediate_size (mlp.experts.*.gate_proj / up_proj rows, stacked in w13)",
                             n, bn, whole_blocks=True),
                    SplitDim("moe_intermediate_size (mlp.experts.*.down_proj columns)", n, bk_ckpt)]
        if cfg.n_shared_experts:
            shared = cfg.n_shared_experts * n
            out += [SplitDim("n_shared_experts x moe_intermediate_size (mlp.shared_experts gate/up rows)",
                             shared, bn_ckpt),
                    SplitDim("n_shared_experts x moe_intermediate_size (mlp.shared_experts.down_proj columns)",
                             shared, bk_ckpt)]
    return out


def split_problem(dim: SplitDim, tp_size: int) -> Optional[str]:
    """Why `dim` cannot be split tp_size ways, or None when it can."""
    if dim.full % tp_size:
        return f"does not divide {dim.what} = {dim.full}"
    if dim.block is None:
        return None
    per = dim.full // tp_size
    if dim.whole_blocks:
        if per % dim.block:
            return (f"gives {dim.what} {dim.full} / {tp_size} = {per} per rank, not a multiple of the "
                    f"{dim.block}-wide FP8 block that the fused MoE kernel needs")
        return None
    for r in range(tp_size):
        start, end = r * per, (r + 1) * per - 1
        if start % dim.block and start // dim.block != end // dim.block:
            return (f"gives {dim.what} {dim.full} / {tp_size} = {per} per rank: rank {r}'s slice "
                    f"[{start}, {end + 1}) straddles a {dim.block}-wide FP8 block")
    return None


def working_tp_sizes(cfg: ModelConfig, fp8_block: Optional[tuple[int, int]] = None,
                     limit: Optional[int] = None, ep: bool = False) -> list[int]:
    """TP sizes (up to `limit`, default the head count) that split this model cleanly."""
    dims = split_dims(cfg, fp8_block, ep)
    top = limit or cfg.num_attention_heads
    return [t for t in range(1, top + 1) if all(split_problem(d, t) is None for d in dims)]


def check_model_divisible(cfg: ModelConfig, tp_size: int, fp8_block: Optional[tuple[int, int]] = None,
                          ep_size: int = 1, attn_tp_size: Optional[int] = None) -> None:
    """UsageError when --tp `tp_size` does not split this model's heads, intermediate sizes, vocab or
    (with `fp8_block`, FP8 weights kept FP8) its 128 x 128 FP8 blocks cleanly; with `ep_size` (= tp)
    when it does not divide the routed experts. `attn_tp_size` (DP attention: tp / dp) is the split
    of the attention heads and vocab, which must work too."""
    ep = ep_size > 1
    if ep and cfg.n_routed_experts % ep_size:
        raise UsageError(f"--ep-size {ep_size} does not divide n_routed_experts = {cfg.n_routed_experts}: each "
                         f"rank owns whole experts; use an --ep-size (= --tp) that divides {cfg.n_routed_experts}")
    attn = attn_tp_size or tp_size
    if attn != tp_size:
        bn, bk = (fp8_block or (None, None)) if cfg.fp8 is not None else (None, None)
        for dim in attention_dims(cfg, bn, bk):
            why = split_problem(dim, attn)
            if why is not None:
                raise UsageError(f"DP attention's attention TP (--tp / --dp = {attn}) {why}: use a larger --dp")
    dims = mlp_dims(cfg, fp8_block, ep) if attn != tp_size else split_dims(cfg, fp8_block, ep)
    for dim in dims:
        why = split_problem(dim, tp_size)
        if why is None:
            continue
        ok = working_tp_sizes(cfg, fp8_block, ep=ep)
        hint = f"TP sizes that work for this model: {', '.join(map(str, ok))}"
        if dim.block is not None and dim.full % tp_size == 0:  # only the FP8 blocks are in the way
            hint += (" (or --quantization none to dequantise the FP8 weights at load)" if cfg.fp8 is not None
                     else " (or drop --quantization fp8)")
        raise UsageError(f"--tp {tp_size} {why}; {hint}")
