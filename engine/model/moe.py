"""DeepSeek MoE: router (three gate methods), routed experts, shared experts.

Routed expert weights are stacked for grouped kernels: w13 [E, 2N, K] (gate rows
then up rows) and w2 [E, K, N]; FP8 checkpoints add block scales. The experts
computation goes through a backend (`TorchMoEBackend` here is the reference).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import FP8_DTYPE, MLP, dequant_block_fp8


def select_experts(logits: torch.Tensor, cfg: ModelConfig,
                   bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, ids [T, k] int64)."""
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    t = logits.shape[0]
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
    if cfg.topk_method == "noaux_tc":
        choice = scores + bias if bias is not None else scores
        groups = choice.view(t, cfg.n_group, e // cfg.n_group)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        ids = _topk_in_groups(choice, group_score, cfg, k)
        weights = scores.gather(1, ids)
    elif cfg.topk_method == "group_limited_greedy":
        group_score = scores.view(t, cfg.n_group, e // cfg.n_group).max(-1).values
        ids = _topk_in_groups(scores, group_score, cfg, k)
        weights = scores.gather(1, ids)
    else:  # greedy
        weights, ids = scores.topk(k, dim=-1)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def _topk_in_groups(choice: torch.Tensor, group_score: torch.Tensor, cfg: ModelConfig, k: int) -> torch.Tensor:
    t, e = choice.shape
    keep = group_score.topk(cfg.topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask.repeat_interleave(e // cfg.n_group, dim=1)
    return choice.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1).indices


class MoEBackend(Protocol):
    def experts(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over the chosen experts of weight * expert(x): [T, hidden]."""


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block=None):
        super().__init__()
        self.cfg = cfg
        e, n, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.fp8_block = fp8_block
        self.gate_weight = nn.Parameter(torch.empty(e, k, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
            if cfg.topk_method == "noaux_tc" else None
        )
        wdtype = FP8_DTYPE if fp8_block else dtype
        self.w13 = nn.Parameter(torch.empty(e, 2 * n, k, dtype=wdtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, k, n, dtype=wdtype), requires_grad=False)
        if fp8_block:
            bn, bk = fp8_block
            self.w13_scale = nn.Parameter(torch.empty(e, -(-2 * n // bn), -(-k // bk)), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(e, -(-k // bn), -(-n // bk)), requires_grad=False)
        else:
            self.w13_scale = self.w2_scale = None
        self.shared_experts = (
            MLP(k, n * cfg.n_shared_experts, dtype, fp8_block) if cfg.n_shared_experts else None
        )
        self.backend: MoEBackend = TorchMoEBackend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate_weight.float())
        weights, ids = select_experts(logits, self.cfg, self.e_score_correction_bias)
        out = self.backend.experts(self, x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13[e], w2[e]) in a plain dtype, dequantised when FP8."""
        if self.fp8_block is None:
            return self.w13[e].to(dtype), self.w2[e].to(dtype)
        return (dequant_block_fp8(self.w13[e], self.w13_scale[e], self.fp8_block, dtype),
                dequant_block_fp8(self.w2[e], self.w2_scale[e], self.fp8_block, dtype))


class TorchMoEBackend:
    """Reference: loop over the experts that received tokens."""

    def experts(self, moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        n = moe.cfg.moe_intermediate_size
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            w13, w2 = moe.expert_weights(e, x.dtype)
            h = F.linear(x[tok], w13)
            h = F.silu(h[:, :n]) * h[:, n:]
            y = F.linear(h, w2) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out
