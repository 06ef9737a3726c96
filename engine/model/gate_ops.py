"""MoE router (hidden states [T, H] and the router weight [E, H], or logits [T, E] float32 with weight None ->
weights [T, k] float32, ids [T, k] int32; with n_shared, k + n_shared columns, the last ones the shared experts
E.. at weight 1): the
implementations the kernel registry (engine/model/kernel_registry.py, op "moe_gate") chooses from:
the fused Triton gate (at decode sizes the logits in the same launch) and its pure-torch reference
(kernels/moe_gate.py: float32 logits, then the gate). Both read the gate method and its parameters from the
model config and are opaque to torch.compile. `pad` (a padded forward's padding rows, engine/model/context.py):
their ids come out -1, no expert.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.checkpoint.config import ModelConfig
from kernels.moe_gate import moe_gate, moe_gate_ref


def _options(cfg: ModelConfig, bias: Optional[torch.Tensor]) -> dict:
    return dict(top_k=cfg.num_experts_per_tok, method=cfg.topk_method, n_group=cfg.n_group,
                topk_group=cfg.topk_group, correction_bias=bias, norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor, scoring_func=cfg.scoring_func)


@torch.compiler.disable
def triton_gate(x: torch.Tensor, weight: Optional[torch.Tensor], cfg: ModelConfig, bias: Optional[torch.Tensor],
                n_shared: int = 0, pad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_gate(x, weight, **_options(cfg, bias), n_shared=n_shared, pad=pad)


@torch.compiler.disable
def torch_gate(x: torch.Tensor, weight: Optional[torch.Tensor], cfg: ModelConfig, bias: Optional[torch.Tensor],
               n_shared: int = 0, pad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_gate_ref(x, weight, **_options(cfg, bias), n_shared=n_shared, pad=pad)
