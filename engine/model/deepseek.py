"""The DeepSeek-V2/V3 causal LM (and its MTP/NextN layer) over packed forward batches.

Every forward takes the runner's `ForwardContext` (engine/model/context.py) and passes it
to each decoder layer, which hands it to its attention and, for MoE layers, to its MoE.

Tensor parallelism: give the constructors this rank's `TPGroup` (engine/distributed/groups.py;
None = an unsplit model, size 1). Each module then allocates only its rank's shard (the rules
of engine/weights/sharding.py) and runs the collectives of that group: one all-reduce after
o_proj, one after each dense MLP or MoE layer, one for the vocab-parallel embedding, and an
all-gather of the vocab-parallel logits, so every rank gets the full logits. A TP size that
does not split the model cleanly is refused here (check_model_divisible), before any weight
is allocated or read. engine/model/builder.py builds and fills a rank's model in one call.

Kernels: the constructors take the `Kernels` the start-up resolved (engine/model/kernel_set.py;
default: the torch reference of each op) and give it to every module they build.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from engine.checkpoint.config import ModelConfig
from engine.distributed import comm
from engine.distributed.divisibility import check_model_divisible
from engine.distributed.expert_placement import ExpertPlacement
from engine.distributed.groups import TPGroup
from engine.forward_batch import ForwardBatch
from engine.model.attention import MLA
from engine.model.context import ForwardContext
from engine.model.kernel_set import REFERENCE, Kernels
from engine.model.layers import (
    MLP,
    Linear,
    RMSNorm,
    solo_group,
    tp_local,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from engine.model.moe import MoE
from engine.model.two_batch import interleave


def check_tp(cfg: ModelConfig, tp: TPGroup, fp8_block=None) -> None:
    """UsageError (which TP sizes work, and why this one does not) unless tp splits cfg's layers cleanly.
    fp8_block: the block of weights kept FP8 (None when they are dequantised or not FP8)."""
    if tp.size > 1:
        check_model_divisible(cfg, tp.size, fp8_block, ep_size=tp.ep_size, attn_tp_size=tp.attention.size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_layer: int, dtype: torch.dtype, fp8_block=None, moe: bool = False,
                 tp: Optional[TPGroup] = None, kernels: Kernels = REFERENCE,
                 placement: Optional[ExpertPlacement] = None, layer: Optional[int] = None):
        """layer: the checkpoint's index of this layer (default: cache_layer; the MTP layer's differs), which
        names it in an expert placement and in the routing counts."""
        super().__init__()
        tp = tp or solo_group()
        layer = cache_layer if layer is None else layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.self_attn = MLA(cfg, cache_layer, dtype, fp8_block, tp.attention, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.is_moe = moe
        self.mlp = (MoE(cfg, dtype, fp8_block, tp, kernels, layer, placement.slots(layer) if placement else None)
                    if moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, fp8_block, tp, kernels=kernels))

    def forward(self, x: torch.Tensor, fb: ForwardBatch, ctx: ForwardContext,
                residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output and `residual` the stream it adds to (None: x is the stream, the
        embedding) -> (this layer's output, the stream it adds to). Each residual add runs inside the norm after
        it (RMSNorm.add / add_for_linear); the caller adds the last layer's output itself."""
        h, residual, gathers = self._attend(x, fb, ctx, residual)
        if gathers:
            h = ctx.dp.gather(h)
        out = self.mlp(h, ctx) if self.is_moe else self.mlp(h)
        return (ctx.dp.scatter(out) if gathers else out), residual

    def stages(self, x: torch.Tensor, fb: ForwardBatch, ctx: ForwardContext,
               residual: Optional[torch.Tensor] = None) -> comm.Stages:
        """`forward` of a two-batch-overlap micro-batch (engine/model/two_batch.py): steps that start DP
        attention's gather and the MoE's collectives asynchronously and yield them. (A generator, so the plain
        `forward` stays one: torch.compile gives up on a whole generator frame at its first graph break.)"""
        h, residual, gathers = self._attend(x, fb, ctx, residual)
        if gathers:
            h = yield ctx.dp.start_gather(h)
        out = (yield from self.mlp.stages(h, ctx)) if self.is_moe else self.mlp(h)
        return (ctx.dp.scatter(out) if gathers else out), residual

    def _attend(self, x: torch.Tensor, fb: ForwardBatch, ctx: ForwardContext,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Norm, attention, norm -> (the MLP's input, the residual stream, whether DP attention gathers the MLP's
        input from every group and scatters its output back)."""
        h, residual = self.input_layernorm.add_for_linear(x, residual, *self.self_attn.input_linears())
        out = self.self_attn(h, fb, ctx) if x.shape[0] else x  # an idle DP-attention forward has no tokens
        if ctx.dp is None and not self.is_moe:  # the dense MLP's GEMM is the norm's only reader
            h, residual = self.post_attention_layernorm.add_for_linear(out, residual, *self.mlp.input_linears())
        else:
            h, residual = self.post_attention_layernorm.add(out, residual)
        gathers = ctx.dp is not None and not (self.is_moe and self.mlp.tp.exchanges_tokens)  # a2a: own rows only
        return h, residual, gathers


class DeepseekForCausalLM(nn.Module):
    """embed -> decoder layers -> norm -> lm_head. KV cache layer i belongs to decoder layer i."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block=None, tp: Optional[TPGroup] = None,
                 kernels: Kernels = REFERENCE, placement: Optional[ExpertPlacement] = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        tp = tp or solo_group()
        check_tp(cfg, tp, fp8_block)
        self.tp = tp.attention  # embedding and lm_head: vocab-parallel over the attention group
        vocab = tp_local(cfg.vocab_size, self.tp, "vocab_size")  # this rank's vocab rows
        self.embed_tokens = nn.Parameter(torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, fp8_block, moe=cfg.is_moe_layer(i), tp=tp, kernels=kernels, placement=placement)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.lm_head = nn.Parameter(torch.empty(vocab, cfg.hidden_size, dtype=dtype), requires_grad=False)

    @contextmanager
    def representative_layers(self):
        """Within it, a forward runs only the first dense and the first MoE decoder layer (each on its own KV
        cache layer): for start-up passes whose outcome depends on the layers' shapes, not on the depth (which
        Triton kernels an extend launches), so that they take two layers' time at 60 layers."""
        every, firsts = self.layers, {}
        for layer in every:
            firsts.setdefault(layer.is_moe, layer)  # in depth order: the first of each kind
        self.layers = nn.ModuleList(firsts.values())
        try:
            yield
        finally:
            self.layers = every

    def hidden_states(self, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Final pre-norm hidden states [T, hidden] of every token in the batch (under two-batch overlap, of its
        two micro-batches run interleaved: `ctx.micro`, planned by `ctx.begin_forward`)."""
        if ctx.micro is not None:
            return self._overlapped(ctx)
        x = vocab_parallel_embedding(fb.input_ids, self.embed_tokens, self.tp, self.kernels.all_reduce)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, fb, ctx, residual)
        return x if residual is None else x + residual

    @torch.compiler.disable
    def _overlapped(self, ctx: ForwardContext) -> torch.Tensor:
        """The two micro-batches' layers, interleaved at their collectives (engine/model/two_batch.py); outside
        torch.compile (a compiled decode graph that splits runs these layers uncompiled)."""
        first, second = ctx.micro
        return torch.cat(interleave(self._stages(first.fb, first.ctx), self._stages(second.fb, second.ctx)))

    def _stages(self, fb: ForwardBatch, ctx: ForwardContext) -> comm.Stages:
        x = vocab_parallel_embedding(fb.input_ids, self.embed_tokens, self.tp, self.kernels.all_reduce)
        residual = None
        for layer in self.layers:
            x, residual = yield from layer.stages(x, fb, ctx, residual)
        return x if residual is None else x + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of the given (pre-norm) hidden rows: the whole vocabulary on every rank."""
        return vocab_parallel_logits(self.norm(hidden), self.lm_head, self.tp)


class MTPLayer(nn.Module):
    """NextN / multi-token-prediction module: predicts token t+2 from token t+1 and h_t.

    Input: concat(enorm(embed(next_token)), hnorm(hidden)) -> eh_proj -> one full
    decoder layer (its own KV cache layer) -> shared_head.norm -> shared_head.head.
    The embedding and head default to the main model's (the checkpoint may ship copies).
    """

    def __init__(self, cfg: ModelConfig, cache_layer: int, dtype: torch.dtype, fp8_block=None,
                 moe: bool = True, tp: Optional[TPGroup] = None, kernels: Kernels = REFERENCE,
                 placement: Optional[ExpertPlacement] = None, layer: Optional[int] = None):
        """layer: its index in the checkpoint (the config's num_hidden_layers), which names it in a placement."""
        super().__init__()
        h = cfg.hidden_size
        self.kernels = kernels
        tp = tp or solo_group()
        self.tp = tp.attention
        # its one decoder layer, checked on its own (cfg may be truncated to dense layers only)
        check_tp(replace(cfg, num_hidden_layers=1, first_k_dense_replace=0 if moe else 1, moe_layer_freq=1),
                 tp, fp8_block)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype, kernels)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype, kernels)
        self.eh_proj = Linear(2 * h, h, dtype, kernels=kernels)  # replicated
        self.layer = DecoderLayer(cfg, cache_layer, dtype, fp8_block, moe=moe, tp=tp, kernels=kernels,
                                  placement=placement, layer=layer)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, kernels)
        self.embed_tokens = None  # set to the main model's unless the checkpoint has its own
        self.head = None

    def forward(self, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] for fb.input_ids (the next tokens) and fb.spec_hidden."""
        e = self.enorm(vocab_parallel_embedding(fb.input_ids, self.embed_tokens, self.tp, self.kernels.all_reduce))
        x = self.eh_proj(torch.cat((e, self.hnorm(fb.spec_hidden)), dim=-1))
        out, residual = self.layer(x, fb, ctx)
        return out + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.shared_head_norm(hidden), self.head, self.tp)
