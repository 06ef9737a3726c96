"""Kernels: the implementation each per-call op of the model runs, as resolved callables.

The kernel registry (engine/model/kernel_registry.py) resolves one name per op at start-up
(flags, 'auto', start-up checks) and `build_kernels` turns the names into a `Kernels`; the model
builder hands that object to every module at construction (DeepseekForCausalLM -> layers), and each
module calls its field: Linear `gemm` (block-FP8 weights only), RMSNorm `rms_norm`, MoE `moe_gate`,
and every layer that reduces over its TP group `all_reduce`; MoE layers of a group that exchanges tokens
(`TPGroup.exchanges_tokens`) send them to their experts' ranks with `moe_a2a`; MLA runs its latent norm, rope and
KV-cache write with `rope_cache` (None: op by op in torch). A decoder layer's residual adds run inside the norms
after them: `add_rms_norm` / `add_norm_quant`, the implementations that go with `rms_norm` / `norm_quant`.
`norm_quant` (None: off) fuses an RMSNorm with the FP8 quantisation of the block-FP8 GEMM it feeds, `act_quant`
(None: off) SwiGLU's SiLU(gate) * up with that of the down projection; Linear then runs `gemm_q` on the quantised
pair.
Nothing is looked up per call and no module branches on the device.

Modules built on their own (tests, meta-device shape checks) get `REFERENCE`: the torch form of
every op, which runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.distributed import comm
from engine.distributed.groups import TPGroup
from engine.distributed.token_exchange import TokenExchange
from engine.model import fp8_ops, gate_ops, norm_ops

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]  # x, w, scale, block
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # x, weight, eps
# (hidden [T, H], router weight [E, H]; or logits [T, E], None), config, correction bias, n_shared (shared experts
# appended), padding rows (bool [<= T] or None: their ids -1) -> (weights, ids)
Gate = Callable[[torch.Tensor, Optional[torch.Tensor], ModelConfig, Optional[torch.Tensor], int,
                 Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
AllReduce = Callable[[torch.Tensor, TPGroup], torch.Tensor]  # sum over the group (identity at size 1)
# x, weight, eps, group -> (q e4m3, group scales), or None where it does not run (then norm and GEMM apart)
NormQuant = Callable[[torch.Tensor, torch.Tensor, float, int], Optional[tuple[torch.Tensor, torch.Tensor]]]
# q, q_scale, w, w_scale, block, out dtype -> y: the block-FP8 linear of an activation quantised already
GemmQ = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int], torch.dtype],
                 torch.Tensor]
# x, residual, weight, eps -> (the norm of x + residual, x + residual)
AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
# x, residual, weight, eps, group -> (q e4m3, group scales, x + residual), or None where it does not run
AddNormQuant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int],
                        Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
# gate_up [M, 2 I], group -> (q e4m3, group scales) of SiLU(gate) * up, or None where it does not run
ActQuant = Callable[[torch.Tensor, int], Optional[tuple[torch.Tensor, torch.Tensor]]]
# q, latent, norm weight, eps, cos, sin, positions, kv_lora_rank, cache (None: no write), slots, kv scale
# -> (q_pe, c_kv, k_pe), or None where it does not run (then the torch form)
RopeCache = Callable[..., Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class Kernels:
    gemm: Gemm  # block-FP8 linear: y = x @ dequant(w).T
    rms_norm: Norm
    moe_gate: Gate  # router: hidden states and router weight (or logits) -> (weights, expert ids)
    all_reduce: AllReduce
    norm_quant: Optional[NormQuant] = None  # None: an RMSNorm before a block-FP8 GEMM runs apart from it
    gemm_q: Optional[GemmQ] = None  # the `gemm` of a quantised activation (set with norm_quant or act_quant)
    moe_a2a: Optional[TokenExchange] = None  # EP all-to-all of MoE tokens (None: gather + all-reduce)
    act_quant: Optional[ActQuant] = None  # None: SiLU(gate) * up apart from the down GEMM's quantisation
    rope_cache: Optional[RopeCache] = None  # MLA's latent norm, rope and cache write in one (None: op by op)
    add_rms_norm: AddNorm = norm_ops.torch_add_rms_norm  # a layer's residual add and the norm after it
    add_norm_quant: Optional[AddNormQuant] = None  # the same, quantised for a block-FP8 GEMM (with norm_quant)
    shared_experts_fused: bool = False  # MoE shared experts run inside the routed experts' launch (engine/model/moe.py)


REFERENCE = Kernels(gemm=fp8_ops.torch_linear, rms_norm=norm_ops.torch_rms_norm, moe_gate=gate_ops.torch_gate,
                    all_reduce=comm.all_reduce)
