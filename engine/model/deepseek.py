"""The DeepSeek-V2/V3 causal LM (and its MTP/NextN layer) over packed forward batches.

Every forward takes the runner's `ForwardContext` (engine/model/context.py) and passes it
to each decoder layer, which hands it to its attention and, for MoE layers, to its MoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model.attention import MLA
from engine.model.context import ForwardContext
from engine.model.layers import MLP, Linear, RMSNorm
from engine.model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_layer: int, dtype: torch.dtype, fp8_block=None, moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, cache_layer, dtype, fp8_block)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_moe = moe
        self.mlp = MoE(cfg, dtype, fp8_block) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, fp8_block)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), fb, ctx)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, ctx) if self.is_moe else self.mlp(h))


class DeepseekForCausalLM(nn.Module):
    """embed -> decoder layers -> norm -> lm_head. KV cache layer i belongs to decoder layer i."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block=None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, fp8_block, moe=cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def hidden_states(self, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Final pre-norm hidden states [T, hidden] of every token in the batch."""
        x = F.embedding(fb.input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, fb, ctx)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given (pre-norm) hidden rows."""
        return F.linear(self.norm(hidden), self.lm_head).float()


class MTPLayer(nn.Module):
    """NextN / multi-token-prediction module: predicts token t+2 from token t+1 and h_t.

    Input: concat(enorm(embed(next_token)), hnorm(hidden)) -> eh_proj -> one full
    decoder layer (its own KV cache layer) -> shared_head.norm -> shared_head.head.
    The embedding and head default to the main model's (the checkpoint may ship copies).
    """

    def __init__(self, cfg: ModelConfig, cache_layer: int, dtype: torch.dtype, fp8_block=None,
                 moe: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * h, h, dtype)
        self.layer = DecoderLayer(cfg, cache_layer, dtype, fp8_block, moe=moe)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.embed_tokens = None  # set to the main model's unless the checkpoint has its own
        self.head = None

    def forward(self, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] for fb.input_ids (the next tokens) and fb.spec_hidden."""
        e = self.enorm(F.embedding(fb.input_ids, self.embed_tokens))
        x = self.eh_proj(torch.cat((e, self.hnorm(fb.spec_hidden)), dim=-1))
        return self.layer(x, fb, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.shared_head_norm(hidden), self.head).float()
