"""The two GEMM kernels of the W4AFP8 fused MoE (kernels/fused_moe_w4a8.py) and the INT4 unpack they share.

One grouped GEMM of the MoE, C[rid] = A[rid // a_row_div] @ B[expert]^T, rows as in kernels/fused_moe.py: A
e4m3 [rows, K] with 1 x G scales, B packed INT4 [E, N_total, K / 2] (kernels/int4.py: element 2j in the low
nibble) with float32 scales [E, N_total, K / G]. Each K step unpacks a tile of packed bytes in registers with a
few bitwise instructions per 32-bit word ("INT4 -> dot operands" below), runs tensor-core dots, scales the fp32
partial product by (activation scale x weight scale) and accumulates in fp32. Two kernels:

- `_w4a8_gemm_kernel` (row-major: C = A @ B^T): interleaves the two nibbles back into K order and dots the
  token rows (BLOCK_M) against them: float16 operands on tiles of BLOCK_M < 64 (mma.sync, whose FP8 path
  upcasts to float16 anyway: exact), e4m3 (v + 8) / 512 with an offset correction from 64 rows (FP8 wgmma).
- `_w4a8_swapped_kernel` (C^T = B @ A^T): the weight rows fill the 64-row side of Hopper's FP8 wgmma straight
  from the registers they were unpacked in, the few token rows the narrow side; A comes de-interleaved per
  INT4 group (the quantisers' `deinterleave`), so each nibble meets a contiguous half of the group and nothing
  is interleaved in registers; the next group's scales are loaded while a group computes. On an H200, tuned,
  it takes 0.75-0.84x the time of the row-major kernel at that kernel's tuned tile from 16 to 256 tokens at TP 4
  and TP 8 of DeepSeek-V3 (0.72-0.97x at EP 8; docs/perf.md, fourteenth GPU session).

`swapped(cfg, group)` says which one a config runs (key SWAP_AB; default: tiles of 64+ weight rows, BLOCK_N).
Config keys beyond kernels/fused_moe.py's: SWAP_AB, FP8_DOT (row-major kernel: force the dot's operand type),
UNPACK_ASM (0: the Triton form of the unpack instead of inline PTX; the CPU interpreter always runs that).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.interpret import interpreting
from kernels.moe_common import gemm_epilogue, launch_gemm, tile_rows
from kernels.pdl import pdl_enter
from kernels.tile_order import grouped_tile

# --------------------------------------------------------------------------- kernels: INT4 -> dot operands
#
# Each packed byte p holds two int4 values, v_lo (element 2j, low nibble) and v_hi (2j + 1, high nibble).
# A nibble n (two's complement v) XOR 8 is u = v + 8 in [0, 15], the offset-binary code; two exact
# conversions follow from it:
# - float16 (the dot of M < 64 tiles: mma.sync, whose FP8 path upcasts to float16 anyway): the bits
#   0x6400 | u are the float16 1024 + u, so v = that - 1032 (exact);
# - e4m3 (FP8 wgmma: the row-major kernel's tiles of M >= 64, every swapped tile): the byte u is the e4m3
#   number u / 512 (subnormals below 8, the first binade above), so the dot gives sum a * (v + 8) / 512 and
#   the kernel subtracts 8 / 512 * sum a (the row-major kernel takes that sum from the same tensor cores with
#   a tile of the byte 8, the swapped one adds up its activation tile).
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


@triton.jit
def _tile(pid_m, pid_n, sorted_ids_ptr, expert_ids_ptr, num_valid, N, a_scale_ptr, b_ptr, b_scale_ptr, stride_asm,
          stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, A_ROW_DIV: tl.constexpr,
          BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, PACKED_K: tl.constexpr):
    """A tile's routed rows (kernels.moe_common.tile_rows), output columns, A rows, and the loop-invariant
    pointers of its first packed [BLOCK_N, PACKED_K] B tile and of its A / B scales (K offsets are added per
    step: fewer live 64-bit registers than advancing pointers)."""
    rid, r_mask, expert = tile_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_valid, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols = offs_n % N
    a_rows = rid // A_ROW_DIV
    b_ptrs = b_ptr + expert * stride_be + (cols[:, None] * stride_bn + tl.arange(0, PACKED_K)[None, :] * stride_bk)
    return (rid, r_mask, offs_n, a_rows, b_ptrs, a_scale_ptr + a_rows * stride_asm,
            b_scale_ptr + expert * stride_bse + cols * stride_bsn)


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
    rid, r_mask, offs_n, a_rows, b_ptrs, as_ptrs, bs_ptrs = _tile(
        pid_m, pid_n, sorted_ids_ptr, expert_ids_ptr, num_valid, N, a_scale_ptr, b_ptr, b_scale_ptr, stride_asm,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, A_ROW_DIV, BLOCK_SIZE_M, BLOCK_SIZE_N, HALF_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, BLOCK_SIZE_K)[None, :] * stride_ak

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


@triton.jit
def _swapped_step(acc, a_lo, a_hi, a_s, shift, packed, b_s, ASM: tl.constexpr):
    """acc [N, M] += one INT4 group of the transposed product: packed [N, G/2] (byte j: elements 2j, 2j + 1),
    a_lo / a_hi [M, G/2] the group's even / odd activation columns (the de-interleaved order), e4m3 dots of
    (v + 8) / 512 and their offset removed: (dot * 512 s_a - 8 s_a sum a) * s_b."""
    lo, hi = _nibbles(packed, True, ASM)
    part = tl.dot(hi, tl.trans(a_hi), tl.dot(lo, tl.trans(a_lo)))
    return acc + (part * a_s[None, :] - shift[None, :]) * b_s[:, None]


@triton.jit(do_not_specialize=["num_valid", "num_pid_m"])
def _w4a8_swapped_kernel(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_w_ptr,
        sorted_ids_ptr, expert_ids_ptr, npp_ptr,
        N, K, num_valid, num_pid_m, up_offset,
        stride_am, stride_ak, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
        stride_cm, stride_cn, a_sum_ptr,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr,
        GROUP_K: tl.constexpr, ASM: tl.constexpr, ACT_SUMS: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr, PDL: tl.constexpr = False):
    """The tile of `_w4a8_gemm_kernel` computed transposed, C^T = B @ A^T: the weight rows (BLOCK_N, 64 and
    up) fill the wide side of Hopper's FP8 wgmma straight from the registers they were unpacked in, the
    tile's few token rows (BLOCK_M) its narrow side. One K step is BLOCK_SIZE_K / GROUP_K whole INT4 groups;
    A comes de-interleaved per group (`deinterleave` of the quantisers: the group's even columns, then its
    odd ones), so the low and high nibbles of a packed tile each meet a contiguous half of it and no
    interleave is needed in registers. With ACT_SUMS the offset correction's per-group sums of A come from the
    quantiser (a_sum_ptr, laid out as A's scales) instead of a reduction over the loaded tile in every program
    (a cross-thread sum and a layout change per group)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(npp_ptr):
        return

    HALF_G: tl.constexpr = GROUP_K // 2
    STEP_GROUPS: tl.constexpr = BLOCK_SIZE_K // GROUP_K
    rid, r_mask, offs_n, a_rows, b_ptrs, as_ptrs, bs_ptrs = _tile(
        pid_m, pid_n, sorted_ids_ptr, expert_ids_ptr, num_valid, N, a_scale_ptr, b_ptr, b_scale_ptr, stride_asm,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, A_ROW_DIV, BLOCK_SIZE_M, BLOCK_SIZE_N, HALF_G)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, HALF_G)[None, :] * stride_ak

    # the scales of group g + 1 are loaded while group g is computed: plain loads, outside the cp.async
    # pipeline of the tiles, whose latency would otherwise stall every group
    last = K // GROUP_K - 1
    a_s_next = tl.load(as_ptrs, mask=r_mask, other=0.0)
    sum_ptrs = a_sum_ptr + a_rows * stride_asm
    a_sum_next = tl.load(sum_ptrs, mask=r_mask, other=0.0) if ACT_SUMS else a_s_next
    b_s_next = tl.load(bs_ptrs)
    up_s_next = tl.load(bs_ptrs + up_offset * stride_bsn) if GATED else b_s_next
    acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    for kk in range(0, K // BLOCK_SIZE_K):
        for j in tl.static_range(STEP_GROUPS):  # a step's groups: each row's bytes of the step loaded together
            g = kk * STEP_GROUPS + j
            a_s, b_s, up_s, a_sum = a_s_next, b_s_next, up_s_next, a_sum_next
            g_next = tl.minimum(g + 1, last)
            a_s_next = tl.load(as_ptrs + g_next * stride_ask, mask=r_mask, other=0.0)
            if ACT_SUMS:
                a_sum_next = tl.load(sum_ptrs + g_next * stride_ask, mask=r_mask, other=0.0)
            b_s_next = tl.load(bs_ptrs + g_next * stride_bsk)
            if GATED:
                up_s_next = tl.load(bs_ptrs + (up_offset * stride_bsn + g_next * stride_bsk))
            a_k = g * GROUP_K * stride_ak
            a_lo = tl.load(a_ptrs + a_k, mask=r_mask[:, None], other=0.0)
            a_hi = tl.load(a_ptrs + (a_k + HALF_G * stride_ak), mask=r_mask[:, None], other=0.0)
            if ACT_SUMS:
                shift = a_sum * (8.0 * a_s)
            else:
                shift = (tl.sum(a_lo.to(tl.float32), axis=1) + tl.sum(a_hi.to(tl.float32), axis=1)) * (8.0 * a_s)
            a_s = a_s * 512.0
            b_k = g * HALF_G * stride_bk
            acc = _swapped_step(acc, a_lo, a_hi, a_s, shift, tl.load(b_ptrs + b_k), b_s, ASM)
            if GATED:
                acc_up = _swapped_step(acc_up, a_lo, a_hi, a_s, shift,
                                       tl.load(b_ptrs + (up_offset * stride_bn + b_k)), up_s, ASM)

    gemm_epilogue(tl.trans(acc), tl.trans(acc_up), c_ptr, topk_w_ptr, rid, r_mask, offs_n, N, stride_cm, stride_cn,
                  GATED, MUL_WEIGHT, INTERPRET)


# --------------------------------------------------------------------------- launch


FP8_DOT_MIN_M = 64  # row tiles from this size use FP8 wgmma (smaller ones mma.sync, float16 operands)


def unpack_mode(cfg: dict) -> tuple[bool, bool]:
    """(FP8_DOT, ASM) of a config: its keys when given, else FP8 dots for row tiles of FP8_DOT_MIN_M and up,
    and the inline-PTX unpack wherever Triton compiles for a GPU (the interpreter runs the Triton form)."""
    fp8_dot = bool(cfg.get("FP8_DOT", cfg["BLOCK_SIZE_M"] >= FP8_DOT_MIN_M))
    return fp8_dot, bool(cfg.get("UNPACK_ASM", 1)) and not interpreting()


SWAPPED_MIN_GROUP = 64  # the swapped kernel's half-group dots are FP8 wgmma, K >= 32 each


def swapped(cfg: dict, group: int) -> bool:
    """Whether a GEMM of INT4 groups of `group` (at least SWAPPED_MIN_GROUP) runs `_w4a8_swapped_kernel` rather
    than `_w4a8_gemm_kernel`: config key SWAP_AB, by default where a tile has the 64 weight rows of one wgmma."""
    return bool(cfg.get("SWAP_AB", cfg["BLOCK_SIZE_N"] >= 64)) and group >= SWAPPED_MIN_GROUP


def act_sums(cfg: dict, group: int) -> bool:
    """Whether the GEMM of `cfg` reads the per-group sums of A from its quantiser: the swapped kernel only, unless
    config key ACT_SUMS is 0 (the kernel then sums each loaded tile itself). On by default: 1.03-1.07x the fused
    MoE's speed at V3's TP 4 / TP 8 shapes, 1-256 tokens, on an H200 (the V3 gate_up tile's loop: 417
    instructions per K step against 489, no shuffles, two barriers against five)."""
    return swapped(cfg, group) and bool(cfg.get("ACT_SUMS", 1))


def launch_w4a8_gemm(a, a_s, b, b_s, c, topk_w, al, *, group, cfg, a_sum=None, **gemm):
    """kernels.moe_common.launch_gemm of the GEMM kernel `cfg` and `group` choose (`gemm`: its shape arguments):
    the swapped one steps whole INT4 groups (BLOCK_SIZE_K rounded down to a multiple of the group that divides
    K, else one group), the other caps its K step at the group. a_sum: A's per-group sums (laid out as a_s,
    from the quantiser) where `act_sums(cfg, group)`."""
    fp8_dot, asm = unpack_mode(cfg)
    if swapped(cfg, group):
        k = gemm["k"]
        step = group * max(1, min(cfg["BLOCK_SIZE_K"], k) // group)
        if (a_sum is not None) != act_sums(cfg, group) or (a_sum is not None and a_sum.stride() != a_s.stride()):
            raise ValueError("a_sum must be given, laid out as a_s, exactly where act_sums(cfg, group)")
        launch_gemm(_w4a8_swapped_kernel, a, a_s, b, b_s, c, topk_w, al, block_k=step if k % step == 0 else group,
                    cfg=cfg, GROUP_K=group, ASM=asm, a_sum_ptr=a_s if a_sum is None else a_sum,
                    ACT_SUMS=a_sum is not None, **gemm)
    else:
        launch_gemm(_w4a8_gemm_kernel, a, a_s, b, b_s, c, topk_w, al, block_k=min(cfg["BLOCK_SIZE_K"], group),
                    cfg=cfg, GROUP_K=group, FP8_DOT=fp8_dot, ASM=asm, **gemm)


__all__ = ["FP8_DOT_MIN_M", "SWAPPED_MIN_GROUP", "act_sums", "launch_w4a8_gemm", "swapped", "unpack_mode"]
