"""SwiGLU's activation, SiLU(gate) * up, fused with the FP8 (e4m3) activation quantisation of the block-FP8 down
projection that reads it.

    q, scale = silu_mul_quant(gate_up)  ==  per_token_group_quant_fp8(F.silu(gate) * up, 128)

where gate_up [M, 2 * I] holds gate in its first I columns and up in the rest (the merged gate_up GEMM's output,
engine/model/layers.py `MLP`).

Why: in torch that is three launches (SiLU, the product, then kernels/fp8.py's group quantisation before the
GEMM) for a few KB at small batches; every dense MLP and every MoE layer's shared experts run it once per step.

Numerics follow the torch form step by step: gate and up in float32, silu = gate / (1 + exp(-gate)) (libdevice's
exp and an IEEE division on the GPU, as torch's CUDA kernel computes it) rounded to the activation dtype, the
product rounded again, then each 1 x 128 group's scale max|h| / 448 (at least `act_eps` / 448) and
q = clamp(h / scale, +-448) in e4m3 (kernels/fp8.py `quant_groups`' operations). The scales come back as a
column-major [M, groups] view, the layout the block GEMM (and cuBLASLt) reads fastest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.fp8 import round_to_e4m3_grid
from kernels.fp8_math import ACT_EPS, FP8_DTYPE, GROUP_SIZE, cdiv, quantize_groups
from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter
from kernels.rms_norm import round_to

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUPS_PER_PROGRAM = 4


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size
def _silu_mul_quant_kernel(X, Q, S, n_rows, inter, stride_x, stride_q, stride_sm, stride_sg, act_eps,
                           GROUP: tl.constexpr, GROUPS: tl.constexpr, EXACT_ROUND: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if EXACT_ROUND:  # the interpreter has no libdevice
        silu = gate / (1.0 + tl.exp(-gate))
    else:
        silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    act = X.dtype.element_ty
    h = round_to(round_to(silu, act, EXACT_ROUND).to(tl.float32) * up, act, EXACT_ROUND).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(h), axis=1), act_eps) / 448.0  # [GROUPS]
    q = round_to_e4m3_grid(tl.clamp(h / scale[:, None], -448.0, 448.0), EXACT_ROUND)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < inter)


def supported(gate_up: torch.Tensor, group: int = GROUP_SIZE) -> bool:
    """Whether `silu_mul_quant` takes this input (else the torch form, then the GEMM quantises)."""
    return (gate_up.dim() == 2 and gate_up.dtype in SUPPORTED_DTYPES and gate_up.shape[1] % 2 == 0
            and gate_up.shape[1] > 0 and gate_up.stride(1) == 1 and group > 0 and group & (group - 1) == 0)


def silu_mul_quant(gate_up: torch.Tensor, group: int = GROUP_SIZE,
                   act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2 * I] (rows may be strided) -> (q [M, I] e4m3, scale [M, ceil(I / group)] float32,
    column-major): the block-FP8 GEMM operands of F.silu(gate) * up."""
    if not supported(gate_up, group):
        raise ValueError(f"silu_mul_quant: unsupported input {tuple(gate_up.shape)} {gate_up.dtype}, "
                         f"strides {gate_up.stride()}, group {group}")
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    groups = cdiv(inter, group)
    q = torch.empty((m, inter), dtype=FP8_DTYPE, device=gate_up.device)
    s = torch.empty((groups, m), dtype=torch.float32, device=gate_up.device).t()
    if m == 0:
        return q, s
    per = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
    _silu_mul_quant_kernel[(m, triton.cdiv(groups, per))](
        gate_up, q, s, m, inter, gate_up.stride(0), q.stride(0), s.stride(0), s.stride(1), float(act_eps),
        GROUP=group, GROUPS=per, EXACT_ROUND=interpreting(), num_warps=4, **launch_options())
    return q, s


def silu_mul_quant_ref(gate_up: torch.Tensor, group: int = GROUP_SIZE,
                       act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps the kernel fuses, in plain torch: (q [M, I] e4m3, scale [M, groups] float32)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_groups(torch.nn.functional.silu(gate) * up, group, act_eps)
