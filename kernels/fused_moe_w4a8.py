"""Fused MoE with INT4 weights and FP8 activations (W4AFP8): the routed experts of `--quantization w4afp8`.

  fused_moe_w4a8(x [T, K], w13 [E, 2N, K/2] int8, w2 [E, K, N/2] int8, topk_ids, topk_weights,
                 w13_scale [E, 2N, K/G1], w2_scale [E, K, N/G2]) -> [T, K]
  out[t] = sum_s w[t, s] * W2[e] @ (silu(G[e] @ x[t]) * (U[e] @ x[t])),  e = topk_ids[t, s]

Weights: symmetric INT4, packed two per byte along K (kernels/int4.py: element 2j in the low nibble),
one float32 scale per (output row, group of G along K); G1 = K / w13_scale.shape[-1],
G2 = N / w2_scale.shape[-1] (each a power of two >= 16). Activations are quantised to e4m3 in
1 x G groups (the weight's group, so each K step of the GEMM has one activation scale and one
weight scale per row). The GEMM tile loads a [BLOCK_N, BLOCK_K/2] tile of packed bytes (as stored: K
contiguous, pipelined through shared memory), turns each byte into its two int4 values with a few bitwise
instructions per 32-bit word (below: "INT4 -> dot operands"), interleaves them back into K order and runs one
tensor-core dot against the FP8 activation tile: float16 operands on tiles of BLOCK_M < 64 (mma.sync, whose
FP8 path upcasts to float16 anyway: exact), e4m3 (v + 8) / 512 with an offset correction on BLOCK_M >= 64
(FP8 wgmma). The fp32 partial product of the K step is scaled by (activation scale x weight scale) and
accumulated in fp32. Config keys beyond kernels/fused_moe.py's: FP8_DOT (0/1: force the dot's operand type),
UNPACK_ASM (0: the Triton form of the unpack instead of inline PTX; the CPU interpreter always runs that).

Steps are those of kernels/fused_moe.py (same routing alignment, kernels/moe_align.py, the same
pieces around the GEMM, kernels/moe_common.py, and the same config keys, tuned per GPU by
`dsctl tune-moe --dtype w4afp8`): [align + quantise x in one launch for decode sizes] -> GEMM1 (gate
and up side by side, SiLU*up) -> quantise -> GEMM2 (x routing weight) -> sum over top_k. No host sync:
CUDA-graph safe. Ids outside [0, E) (experts of another EP rank) contribute nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import per_token_group_quant_fp8
from kernels.fp8_math import dequant_groups, quantize_groups
from kernels.int4 import dequant_int4
from kernels.interpret import interpreting
from kernels.moe_common import (
    align_and_quant,
    check_routing,
    gemm_epilogue,
    launch_gemm,
    moe_inputs,
    moe_sum,
    split_config,
    tile_rows,
)
from kernels.pdl import pdl_enter
from kernels.tile_order import grouped_tile
from kernels.tuned_configs import get_moe_config

DTYPE_NAME = "w4afp8"  # the tuned-config files' dtype= part

# --------------------------------------------------------------------------- reference


def groups(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> tuple[int, int]:
    """(G1, G2): the K groups of the gate_up and down weights, from the packed shapes and their scales."""
    if not w13_scale.shape[2] or not w2_scale.shape[2]:
        raise ValueError(f"INT4 scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} have no K group")
    return 2 * w13.shape[2] // w13_scale.shape[2], 2 * w2.shape[2] // w2_scale.shape[2]


def _act(x: torch.Tensor, group: int, quantize: bool) -> torch.Tensor:
    if not quantize:
        return x.float()
    q, s = quantize_groups(x, group)
    return dequant_groups(q, s, group)


def fused_moe_w4a8_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                       compute_dtype: torch.dtype = torch.float32, quantize: bool = True) -> torch.Tensor:
    """Loop over the experts that received tokens. With `quantize` it mirrors the kernel's roundings
    (e4m3 activations in 1 x G groups, intermediate stored in x.dtype); with quantize=False and
    float64 it is the exact maths of the INT4 weights with unquantised activations."""
    t, k = x.shape
    g1, g2 = groups(w13, w2, w13_scale, w2_scale)
    n = w2.shape[2] * 2
    out = torch.zeros((t, k), dtype=compute_dtype, device=x.device)
    ids = topk_ids.long()
    xa = _act(x, g1, quantize).to(compute_dtype)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xa[tok] @ dequant_int4(w13[e], w13_scale[e], compute_dtype).T
        act = F.silu(h[:, :n]) * h[:, n:]
        if quantize:
            act = _act(act.to(x.dtype), g2, True).to(compute_dtype)
        y = (act @ dequant_int4(w2[e], w2_scale[e], compute_dtype).T) * topk_weights[tok, slot, None].to(compute_dtype)
        if quantize:
            y = y.to(x.dtype).to(compute_dtype)
        out.index_add_(0, tok, y)
    return out if compute_dtype == torch.float64 else out.to(x.dtype)


# --------------------------------------------------------------------------- kernels: INT4 -> dot operands
#
# Each packed byte p holds two int4 values, v_lo (element 2j, low nibble) and v_hi (2j + 1, high nibble).
# A nibble n (two's complement v) XOR 8 is u = v + 8 in [0, 15], the offset-binary code; two exact
# conversions follow from it:
# - float16 (the dot of M < 64 tiles: mma.sync, whose FP8 path upcasts to float16 anyway): the bits
#   0x6400 | u are the float16 1024 + u, so v = that - 1032 (exact);
# - e4m3 (the dot of M >= 64 tiles, FP8 wgmma): the byte u is the e4m3 number u / 512 (subnormals below
#   8, the first binade above), so the dot gives sum a * (v + 8) / 512 and the kernel subtracts
#   8 / 512 * sum a, taken by the same tensor cores from a tile of the byte 8.
# The ASM forms do this on 32-bit words (4 packed bytes, 8 values) in a few bitwise instructions; the
# Triton forms are the same maths element by element (the CPU interpreter runs those).

_F16_ASM = tl.constexpr("""{
.reg .b32 t0, t1, c, h, m;
mov.b32 c, 0x64086408;
mov.b32 h, 0x2C002C00;
mov.b32 m, 0xD480D480;
prmt.b32 t0, $4, $4, 0x1100;
prmt.b32 t1, $4, $4, 0x3322;
lop3.b32 $0, t0, 0x000F000F, 0x64086408, 0x6A;
lop3.b32 $1, t1, 0x000F000F, 0x64086408, 0x6A;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
lop3.b32 $2, t0, 0x00F000F0, 0x64806480, 0x6A;
lop3.b32 $3, t1, 0x00F000F0, 0x64806480, 0x6A;
fma.rn.f16x2 $2, $2, h, m;
fma.rn.f16x2 $3, $3, h, m;
}""")
# t0 = bytes (b0, b0, b1, b1), t1 = (b2, b2, b3, b3); lop3 0x6A is (a & b) ^ c: the low nibbles of bytes
# 0 and 2 of t (the elements b_i, b_i+1) XOR 8 under the float16 exponent 0x64 -> 1024 + u, minus 1032;
# the high nibbles land 4 bits up (1024 + 16 u) and fma(x, 1/16, -72) gives u - 8.

_E4M3_ASM = tl.constexpr("""{
.reg .b32 t;
lop3.b32 $0, $2, 0x0F0F0F0F, 0x08080808, 0x6A;
shr.u32 t, $2, 4;
lop3.b32 $1, t, 0x0F0F0F0F, 0x08080808, 0x6A;
}""")


@triton.jit
def _nibbles(packed, FP8_DOT: tl.constexpr, ASM: tl.constexpr):
    """A packed int4 tile -> (low-nibble values, high-nibble values), same shape: float16 v, or with FP8_DOT
    the e4m3 numbers (v + 8) / 512."""
    if FP8_DOT:
        if ASM:
            lo, hi = tl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r", [packed], dtype=(tl.int8, tl.int8),
                                               is_pure=True, pack=4)
        else:
            lo = ((packed & 0xF) ^ 8).to(tl.int8)
            hi = (((packed >> 4) & 0xF) ^ 8).to(tl.int8)
        lo = lo.to(tl.float8e4nv, bitcast=True)
        hi = hi.to(tl.float8e4nv, bitcast=True)
    elif ASM:
        lo, hi = tl.inline_asm_elementwise(_F16_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        wide = packed.to(tl.int16)
        lo = ((wide & 0xF) ^ 0x6408).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        hi = (((wide >> 4) & 0xF) ^ 0x6408).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    return lo, hi


@triton.jit
def _int4_dot(a, packed, FP8_DOT: tl.constexpr, ASM: tl.constexpr):
    """An A tile [M, K] (float16, or e4m3 with FP8_DOT) x a packed int4 tile [N, K/2] (B transposed, as stored)
    -> fp32 [M, N]: sum a * v (float16), or sum a * (v + 8) / 512 (FP8_DOT)."""
    lo, hi = _nibbles(packed, FP8_DOT, ASM)
    return tl.dot(a, tl.trans(tl.interleave(lo, hi)))


@triton.jit
def _eights(BLOCK_K: tl.constexpr):
    """A [BLOCK_K, 16] e4m3 tile of the byte 8 (8 / 512) for FP8_DOT's correction (see above): a [M, K] dot it
    is sum a * 8 / 512 in every column, of which max takes one exactly."""
    return tl.full((BLOCK_K, 16), 8, tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit(do_not_specialize=["num_valid", "num_pid_m"])
def _w4a8_gemm_kernel(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_w_ptr,
        sorted_ids_ptr, expert_ids_ptr, npp_ptr,
        N, K, num_valid, num_pid_m, up_offset,
        stride_am, stride_ak, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
        stride_cm, stride_cn,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr,
        GROUP_K: tl.constexpr, FP8_DOT: tl.constexpr, ASM: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr, PDL: tl.constexpr = False):
    """One [BLOCK_M rows of one expert] x [BLOCK_N output columns] tile (rows as in kernels/fused_moe.py).

    A is e4m3 [rows, K] with scales [rows, K / GROUP_K]; B is packed int4 [E, N_total, K / 2] with
    scales [E, N_total, K / GROUP_K]. BLOCK_SIZE_K divides GROUP_K (one scale pair per K step), which
    divides K (no K masks)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(npp_ptr):
        return

    HALF_K: tl.constexpr = BLOCK_SIZE_K // 2  # packed byte j of a K step holds K elements 2j and 2j + 1
    rid, r_mask, expert = tile_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_valid, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols = offs_n % N
    a_rows = rid // A_ROW_DIV

    # loop-invariant pointers, K offsets added per step (fewer live 64-bit registers than advancing pointers)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, BLOCK_SIZE_K)[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + (cols[:, None] * stride_bn + tl.arange(0, HALF_K)[None, :] * stride_bk)
    as_ptrs = a_scale_ptr + a_rows * stride_asm
    bs_ptrs = b_scale_ptr + expert * stride_bse + cols * stride_bsn

    eights = _eights(BLOCK_SIZE_K)
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(0, K // BLOCK_SIZE_K):
        a = tl.load(a_ptrs + kk * BLOCK_SIZE_K * stride_ak, mask=r_mask[:, None], other=0.0)
        kg = (kk * BLOCK_SIZE_K) // GROUP_K
        a_s = tl.load(as_ptrs + kg * stride_ask, mask=r_mask, other=0.0)
        if FP8_DOT:  # sum a * v * s_a = (dot - offset) * 512 s_a: one FMA per element, then one for s_b
            a_s = a_s * 512.0
            shift = tl.max(tl.dot(a, eights), axis=1) * a_s
        else:
            shift = tl.zeros_like(a_s)
            a = a.to(tl.float16)
        b_k = kk * HALF_K * stride_bk
        s_k = kg * stride_bsk
        part = _int4_dot(a, tl.load(b_ptrs + b_k), FP8_DOT, ASM)
        acc += (part * a_s[:, None] - shift[:, None]) * tl.load(bs_ptrs + s_k)[None, :]
        if GATED:
            part = _int4_dot(a, tl.load(b_ptrs + (up_offset * stride_bn + b_k)), FP8_DOT, ASM)
            b_s = tl.load(bs_ptrs + (up_offset * stride_bsn + s_k))
            acc_up += (part * a_s[:, None] - shift[:, None]) * b_s[None, :]

    gemm_epilogue(acc, acc_up, c_ptr, topk_w_ptr, rid, r_mask, offs_n, N, stride_cm, stride_cn,
                  GATED, MUL_WEIGHT, INTERPRET)


# --------------------------------------------------------------------------- wrapper


def _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale) -> tuple[int, int, int, int, int, int]:
    t, k = x.shape
    e, two_n, k_half = w13.shape
    n = two_n // 2
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        raise ValueError(f"W4AFP8 weights are packed int8, got {w13.dtype} / {w2.dtype}")
    if 2 * k_half != k or two_n % 2 or tuple(w2.shape) != (e, k, n // 2) or n % 2:
        raise ValueError(f"shapes: x {tuple(x.shape)}, packed w13 {tuple(w13.shape)}, packed w2 {tuple(w2.shape)}")
    if w13_scale.shape[:2] != (e, two_n) or w2_scale.shape[:2] != (e, k):
        raise ValueError(f"scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} do not match the weights")
    check_routing(t, topk_ids, topk_weights)
    g1, g2 = groups(w13, w2, w13_scale, w2_scale)
    for g, dim, s in ((g1, k, w13_scale), (g2, n, w2_scale)):
        if g < 16 or g & (g - 1) or g * s.shape[-1] != dim:
            raise ValueError(f"INT4 group {g} along K = {dim}: must be a power of two >= 16 that tiles K")
    return t, k, e, n, g1, g2


FP8_DOT_MIN_M = 64  # row tiles from this size use FP8 wgmma (smaller ones mma.sync, float16 operands)


def unpack_mode(cfg: dict) -> tuple[bool, bool]:
    """(FP8_DOT, ASM) of a config: its keys when given, else FP8 dots for row tiles of FP8_DOT_MIN_M and up,
    and the inline-PTX unpack wherever Triton compiles for a GPU (the interpreter runs the Triton form)."""
    fp8_dot = bool(cfg.get("FP8_DOT", cfg["BLOCK_SIZE_M"] >= FP8_DOT_MIN_M))
    return fp8_dot, bool(cfg.get("UNPACK_ASM", 1)) and not interpreting()


def _launch(a, a_s, b, b_s, c, topk_w, al, *, group, cfg, **gemm):
    """kernels.moe_common.launch_gemm of `_w4a8_gemm_kernel` (`gemm`: its shape arguments); the K step is
    capped at the INT4 group."""
    fp8_dot, asm = unpack_mode(cfg)
    launch_gemm(_w4a8_gemm_kernel, a, a_s, b, b_s, c, topk_w, al, block_k=min(cfg["BLOCK_SIZE_K"], group), cfg=cfg,
                GROUP_K=group, FP8_DOT=fp8_dot, ASM=asm, **gemm)


def fused_moe_w4a8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                   config: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed-experts output [T, K] in x.dtype (see the module docstring). `config` (the keys of
    kernels/fused_moe.py: BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, `<KEY>_DOWN`) defaults
    to the tuned file `dtype=w4afp8` for (E, N, device) at the batch size nearest T, else a default;
    BLOCK_SIZE_K is capped at the INT4 group."""
    t, k, e, n, g1, g2 = _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale)
    inp = moe_inputs(x, topk_ids, topk_weights, out)
    if inp.empty:
        return inp.out.zero_()
    cfg = config or get_moe_config(e, n, t, inp.top_k, DTYPE_NAME, device=x.device)
    up_cfg, down_cfg = split_config(cfg)

    al, a1, a1_s = align_and_quant(inp.x, inp.ids, e, cfg["BLOCK_SIZE_M"], g1)
    h = torch.empty((inp.num_valid, n), dtype=inp.inter_dtype, device=x.device)
    _launch(a1, a1_s, w13, w13_scale, h, inp.weights, al, group=g1, cfg=up_cfg, **inp.up_gemm(n, k))
    a2, a2_s = per_token_group_quant_fp8(h, g2)
    y = torch.empty((inp.num_valid, k), dtype=inp.inter_dtype, device=x.device)
    _launch(a2, a2_s, w2, w2_scale, y, inp.weights, al, group=g2, cfg=down_cfg, **inp.down_gemm(n, k))
    return moe_sum(y, inp, e)


__all__ = ["DTYPE_NAME", "fused_moe_w4a8", "fused_moe_w4a8_ref", "groups"]
