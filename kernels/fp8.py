"""FP8 (e4m3) kernels: per-token-group quantisation, block-FP8 GEMM, FP8 batched matmul.

Formats (DeepSeek-V3 "fp8 block" checkpoints):
- activations: quantised on the fly in 1 x 128 groups along K; one float32 scale
  per (row, group); q = clamp(x / s, +-448) with s = max|x| / 448.
- weights: float8_e4m3fn, one float32 scale per 128 x 128 tile (the checkpoint's
  `weight_scale_inv`); the real weight is fp8 * scale.
Products accumulate in float32; outputs are bf16 (or the input dtype).

`fp8_bmm` is the batched matmul of the absorbed MLA weights (W_UK, W_UV): one
matrix per head, B[h] in [K, N] orientation, with per-tensor, per-head or 128 x 128
block scales (see its docstring). Every kernel has a `*_ref` pure-torch twin, written with
the block maths of kernels/fp8_math.py (scale shapes, quantise, dequantise), which the
kernels here reproduce on the device.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.fp8_math import (
    ACT_EPS,
    FP8_DTYPE,
    GROUP_SIZE,
    block_scale_shape,
    cdiv,
    dequant_block_fp8,
    dequant_groups,
    quantize_groups,
)
from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter
from kernels.split_k import arrive, k_range, plan, sum_slots, tile_slots
from kernels.tile_order import grouped_tile
from kernels.tuned_configs import get_fp8_gemm_config

# --------------------------------------------------------------------------- references


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int = GROUP_SIZE,
                                  eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """What `per_token_group_quant_fp8` computes: x [..., K] -> (q [..., K] float8_e4m3fn,
    scale [..., ceil(K/group)] float32), i.e. kernels.fp8_math.quantize_groups."""
    return quantize_groups(x, group_size, eps)


def block_fp8_matmul_ref(a: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                         block: tuple[int, int] = (128, 128), out_dtype: Optional[torch.dtype] = None,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What `block_fp8_matmul` computes: quantise a (1 x block[1]), dequantise both, a @ b.T."""
    aq, a_s = quantize_groups(a, block[1])
    a_deq = dequant_groups(aq, a_s, block[1]).to(compute_dtype)
    b_deq = dequant_block_fp8(b_fp8, b_scale, block, compute_dtype)
    return (a_deq @ b_deq.T).to(out_dtype or a.dtype)


def _bmm_scale_3d(b_scale: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-tensor / per-head / block scales -> a [batch, kb, nb] view (stride 0 where broadcast)."""
    s = b_scale.float()
    if s.dim() == 0 or (s.dim() == 1 and s.numel() == 1):
        return s.reshape(1, 1, 1).expand(batch, 1, 1)
    if s.dim() == 1:
        if s.numel() != batch:
            raise ValueError(f"per-head scale has {s.numel()} entries for {batch} heads")
        return s.view(batch, 1, 1)
    if s.dim() == 3 and s.shape[0] == batch:
        return s
    raise ValueError(f"fp8_bmm scale of shape {tuple(b_scale.shape)} is not [], [1], [B] or [B, kb, nb]")


def fp8_bmm_ref(a: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                block: tuple[int, int] = (128, 128), out_dtype: Optional[torch.dtype] = None,
                compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What `fp8_bmm` computes: a [B, M, K] quantised 1 x block[0] along K, B[h] [K, N] dequantised."""
    bsz, k, n = b_fp8.shape
    aq, a_s = quantize_groups(a, block[0])
    a_deq = dequant_groups(aq, a_s, block[0]).to(compute_dtype)
    s = _bmm_scale_3d(b_scale, bsz)
    kb, nb = s.shape[1], s.shape[2]
    blk = (block[0] if kb > 1 else k, block[1] if nb > 1 else n)
    b_deq = dequant_block_fp8(b_fp8, s, blk, compute_dtype)
    return torch.bmm(a_deq, b_deq).to(out_dtype or a.dtype)


# --------------------------------------------------------------------------- triton kernels


@triton.jit
def round_to_e4m3_grid(v, EXACT_ROUND: tl.constexpr):
    """Round float32 values in [-448, 448] to the e4m3 grid (round to nearest even).

    Only used under the CPU interpreter, whose float32 -> e4m3 cast mis-rounds values
    that round up across a power of two (e.g. 1.97 -> 1.0); the GPU cast is exact.
    """
    if EXACT_ROUND:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits
        normal = bits.to(tl.float32, bitcast=True)
        sub = (v + 24576.0) - 24576.0  # multiples of 2**-9 below 2**-6 (e4m3 subnormals)
        v = tl.where(tl.abs(v) < 0.015625, sub, normal)
    return v


@triton.jit
def store_cast(v, ptr, EXACT_ROUND: tl.constexpr):
    """v (float32) cast to ptr's element type; under the interpreter, whose float32 -> bf16
    cast truncates, round to nearest even first (the GPU cast already does)."""
    if EXACT_ROUND:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            v = bits.to(tl.float32, bitcast=True)
    return v.to(ptr.dtype.element_ty)


@triton.jit
def quant_tile(x, EXACT_ROUND: tl.constexpr):
    """x [R, GROUP] float32, one quantisation group per row -> (q on the e4m3 grid, float32; scale [R])."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    q = round_to_e4m3_grid(tl.clamp(x / scale[:, None], -448.0, 448.0), EXACT_ROUND)
    return q, scale


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, sum_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, EXACT_ROUND: tl.constexpr,
                        DEINTERLEAVE: tl.constexpr = False, SUMS: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    quant_groups(x_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), K, stride_xm, stride_qm, stride_sm,
                 stride_sg, eps, GROUP, GROUPS_PER_PROG, EXACT_ROUND, DEINTERLEAVE, sum_ptr, SUMS)


@triton.jit
def quant_groups(x_ptr, q_ptr, s_ptr, row, gblk, K, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                 GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, EXACT_ROUND: tl.constexpr,
                 DEINTERLEAVE: tl.constexpr = False, sum_ptr=None, SUMS: tl.constexpr = False):
    """Quantise groups [gblk * GROUPS_PER_PROG, +GROUPS_PER_PROG) of one row (also used by the MoE prologue).
    DEINTERLEAVE stores each group's even columns first, then its odd ones (`deinterleave_groups`). SUMS also
    stores each group's sum of its quantised values (before the scale) at sum_ptr, laid out as the scales."""
    row = row.to(tl.int64)
    g = gblk * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    src = cols
    if DEINTERLEAVE:  # output column p of a group holds input column 2 (p mod G/2) + p div G/2
        p = tl.arange(0, GROUP)
        src = g[:, None] * GROUP + (2 * (p % (GROUP // 2)) + p // (GROUP // 2))[None, :]
    x = tl.load(x_ptr + row * stride_xm + src, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / 448.0
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    q = round_to_e4m3_grid(q, EXACT_ROUND)
    q = q.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < K)
    if SUMS:  # the stored values' sums: on the GPU the cast above is what rounds them to e4m3
        tl.store(sum_ptr + row * stride_sm + g * stride_sg, tl.sum(q.to(tl.float32), axis=1), mask=g * GROUP < K)


@triton.jit(do_not_specialize=["M"])
def _block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, count_ptr, M, N, K,
                           stride_am, stride_ak, stride_asm, stride_asg,
                           stride_bn, stride_bk, stride_bsn, stride_bsk, stride_cm, stride_cn,
                           GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, QUANT_A: tl.constexpr,
                           BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                           BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr,
                           EXACT_ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """C = A @ B.T. A is e4m3 with 1 x GROUP_K scales (as_ptr), or, with QUANT_A, bf16/fp32
    quantised here tile by tile (BLOCK_SIZE_K == GROUP_K). B [N, K] e4m3, GROUP_N x GROUP_K scales.

    With SPLIT_K > 1, program (tile, s) sums the s-th of SPLIT_K runs of K blocks into its float32 slot
    of ws, and the last of the tile's programs to arrive stores C (kernels/split_k.py)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    rows = (offs_m % M).to(tl.int64)  # wrap: out-of-range rows read valid memory, never stored
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    k_first, k_end = k_range(K, BLOCK_SIZE_K, SPLIT_K, split)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k_first * BLOCK_SIZE_K + offs_k[None, :]) * stride_ak
    b_ptrs = b_ptr + cols[None, :] * stride_bn + (k_first * BLOCK_SIZE_K + offs_k[:, None]) * stride_bk
    as_ptrs = as_ptr + rows * stride_asm
    if BLOCK_SIZE_N <= GROUP_N:  # the whole tile shares one weight-scale row
        bs_ptrs = bs_ptr + ((pid_n * BLOCK_SIZE_N) // GROUP_N) * stride_bsn
    else:
        bs_ptrs = bs_ptr + (cols // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(k_first, k_end):
        k_left = K - kk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        kg = (kk * BLOCK_SIZE_K) // GROUP_K
        if QUANT_A:
            aq, a_s = quant_tile(a.to(tl.float32), EXACT_ROUND)
            a = aq.to(b.dtype)
        else:
            a_s = tl.load(as_ptrs + kg * stride_asg)
        b_s = tl.load(bs_ptrs + kg * stride_bsk)
        if BLOCK_SIZE_N <= GROUP_N:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptrs, store_cast(acc, c_ptr, EXACT_ROUND), mask=mask)
    else:
        slots = tile_slots(ws_ptr, pid, SPLIT_K, BLOCK_SIZE_M, BLOCK_SIZE_N)
        tl.store(slots + split * (BLOCK_SIZE_M * BLOCK_SIZE_N), acc)
        if arrive(count_ptr, pid, SPLIT_K):
            total = sum_slots(slots, 0, SPLIT_K, BLOCK_SIZE_M, BLOCK_SIZE_N)
            tl.store(c_ptrs, store_cast(total, c_ptr, EXACT_ROUND), mask=mask)


@triton.jit
def _fp8_bmm_kernel(a_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                    stride_sb, stride_sk, stride_sn, stride_cb, stride_cm, stride_cn,
                    SCALE_BK: tl.constexpr, SCALE_BN: tl.constexpr, EXACT_ROUND: tl.constexpr,
                    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                    PDL: tl.constexpr = False):
    """C[h] = quant(A[h]) @ B[h]; A quantised here, 1 x BLOCK_SIZE_K groups (BLOCK_SIZE_K = 128)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    m_mask = offs_m < M
    cols = offs_n % N
    a_ptrs = a_ptr + h * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + h * stride_bb + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    s_ptrs = bs_ptr + h * stride_sb + (cols // SCALE_BN) * stride_sn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_mask = offs_k < K - kk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        aq, a_s = quant_tile(a, EXACT_ROUND)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        b_s = tl.load(s_ptrs + ((kk * BLOCK_SIZE_K) // SCALE_BK) * stride_sk)
        acc += tl.dot(aq.to(b.dtype), b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    c_ptrs = c_ptr + h * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, store_cast(acc, c_ptr, EXACT_ROUND), mask=m_mask[:, None] & (offs_n[None, :] < N))


# --------------------------------------------------------------------------- wrappers


def groups_per_program(groups: int, group_size: int) -> int:
    return min(triton.next_power_of_2(groups), max(1, 1024 // group_size))


def check_deinterleave(k: int, group_size: int, deinterleave: bool) -> None:
    """A de-interleaved quantisation (`quant_groups`' DEINTERLEAVE) needs K in whole groups (ValueError otherwise)."""
    if deinterleave and k % group_size:
        raise ValueError(f"de-interleaved quantisation needs whole groups: K = {k}, group {group_size}")


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = GROUP_SIZE, column_major_scales: bool = False,
                              eps: float = ACT_EPS, deinterleave: bool = False, sums: bool = False) -> tuple:
    """x [..., K] (last dim contiguous) -> (q [..., K] e4m3, scale [..., ceil(K/group)] float32).

    With `column_major_scales` the scale of a 2-D x is a [M, G] view of a [G, M]
    buffer (stride (1, M)), the layout the block GEMM reads fastest. With `deinterleave` q holds each
    group's even columns, then its odd ones (kernels.fp8_math.deinterleave_groups; whole groups only).
    With `sums` a third tensor, laid out as the scales: each group's sum of its quantised values (unscaled,
    float32), what the W4AFP8 GEMM's INT4 offset correction needs (kernels/w4a8_gemm.py).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    *lead, k = x.shape
    check_deinterleave(k, group_size, deinterleave)
    x2 = x.reshape(-1, k)
    m, g = x2.shape[0], cdiv(k, group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        if len(lead) != 1:
            raise ValueError("column-major scales need a 2-D input")
        s = torch.empty((g, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    total = torch.empty_strided(s.shape, s.stride(), dtype=torch.float32, device=x.device) if sums else s
    if m and k:
        gpp = groups_per_program(g, group_size)
        _group_quant_kernel[(m, cdiv(g, gpp))](
            x2, q, s, total, k, x2.stride(0), q.stride(0), s.stride(0), s.stride(1), eps,
            GROUP=group_size, GROUPS_PER_PROG=gpp, EXACT_ROUND=interpreting(), DEINTERLEAVE=deinterleave,
            SUMS=sums, num_warps=4, **launch_options())
    out = (q.view(*lead, k), (s if column_major_scales else s.view(*lead, g)))
    return out + ((total if column_major_scales else total.view(*lead, g)),) if sums else out


def block_fp8_matmul(a: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                     block: tuple[int, int] = (128, 128), out_dtype: Optional[torch.dtype] = None,
                     config: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                     cublas: bool = True) -> torch.Tensor:
    """a [..., K] (bf16/fp16/fp32) @ b.T with b [N, K] e4m3 and b_scale [ceil(N/bn), ceil(K/bk)] float32.

    `a` is quantised on the fly in 1 x bk groups (by a separate pass, or inside the GEMM
    when the config has QUANT_A=1); accumulation is float32; the output has a's dtype
    unless `out_dtype` says otherwise (or is written into `out`, [M, N] with any strides,
    M = a's rows). `config` (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages,
    optional QUANT_A; CUBLAS=1 takes cuBLASLt's block-scaled FP8 GEMM where torch offers it and
    K % 512 == 0, else the Triton kernel with the same dict; optional SPLIT_K, the number of parts the
    Triton kernel's K loop is split into, else `split_k_for`'s choice) defaults to the tuned file for
    (N, K) at the M nearest a's rows. `cublas=False` ignores the CUBLAS key (the Triton kernel only).
    """
    k = b_fp8.shape[1]
    if a.shape[-1] != k:
        raise ValueError(f"a has K={a.shape[-1]}, b has K={k}")
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    m, n = a2.shape[0], b_fp8.shape[0]
    cfg = dict(config or get_fp8_gemm_config(n, k, m, device=a.device))
    if cublas and cfg.get("CUBLAS", 0) and m and cublas_block_fp8_supported(a.device, block, k, n):
        aq, a_s = per_token_group_quant_fp8(a2, block[1], column_major_scales=True)
        res = cublas_block_fp8_matmul(aq, a_s, b_fp8, b_scale, out_dtype or a.dtype, out)
    elif cfg.get("QUANT_A", 0) and m:
        if a2.stride(-1) != 1:
            a2 = a2.contiguous()
        res = _block_gemm(a2, None, b_fp8, b_scale, block, out_dtype or a.dtype, cfg, out)
    else:
        aq, a_s = per_token_group_quant_fp8(a2, block[1], column_major_scales=True)
        res = _block_gemm(aq, a_s, b_fp8, b_scale, block, out_dtype or a.dtype, cfg, out)
    return res.view(*lead, n) if res.is_contiguous() else res


def block_fp8_matmul_q(aq: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor,
                       block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16,
                       config: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                       cublas: bool = True) -> torch.Tensor:
    """block_fp8_matmul for an already quantised a: aq [M, K] e4m3 with a_scale [M, ceil(K/bk)]
    (any strides; column-major reads fastest), e.g. the output of kernels/rms_norm_quant.py. The tuned
    config's QUANT_A key does not apply (a is quantised already); `cublas=False` ignores its CUBLAS key."""
    cfg = dict(config or get_fp8_gemm_config(b_fp8.shape[0], b_fp8.shape[1], aq.shape[0], device=aq.device))
    if (cublas and cfg.get("CUBLAS", 0) and aq.shape[0]
            and cublas_block_fp8_supported(aq.device, block, *b_fp8.shape[::-1])):
        return cublas_block_fp8_matmul(aq, a_scale, b_fp8, b_scale, out_dtype, out)
    return _block_gemm(aq, a_scale, b_fp8, b_scale, block, out_dtype, cfg, out)


_CUBLAS_STATE: dict = {}


def cublas_block_fp8_supported(device, block=(128, 128), k: Optional[int] = None, n: Optional[int] = None) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM (torch._scaled_mm with 1x128 / 128x128 float32
    scales, CUDA >= 12.9, sm90) can run this product here.

    Only K a multiple of 512 (a multiple of 4 scale blocks): with torch 2.11 + cuBLAS 13 on an
    H100 an unaligned K (e.g. 2304) ran without error and gave wrong results; and N a multiple
    of 16 (cuBLASLt's output alignment; every DeepSeek shape is). Probed once per
    process against a dequantised reference; `_CUBLAS_STATE['why']` keeps the reason when not.
    """
    if tuple(block) != (128, 128) or torch.device(device).type != "cuda" or interpreting():
        return False
    if (k is not None and k % 512) or (n is not None and n % 16):
        return False
    if "ok" not in _CUBLAS_STATE:
        if torch.cuda.is_current_stream_capturing():  # cannot probe inside a graph capture: not now
            return False
        _CUBLAS_STATE["ok"] = False
        try:
            _CUBLAS_STATE["ok"] = _probe_cublas(device)
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            _CUBLAS_STATE["why"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return _CUBLAS_STATE["ok"]


def cublas_unavailable_reason(device) -> str:
    """Why cuBLASLt's block-scaled FP8 GEMM cannot run on `device` ('' when it can: probes like
    cublas_block_fp8_supported)."""
    if torch.device(device).type != "cuda" or interpreting():
        return "cuBLASLt's block-scaled FP8 GEMM needs a CUDA GPU"
    if cublas_block_fp8_supported(device):
        return ""
    return "cuBLASLt's block-scaled FP8 GEMM is not available here (" + _CUBLAS_STATE.get("why", "no support") + ")"


def _probe_cublas(device) -> bool:
    """A small product with distinct scales per block (2 x 4 weight blocks, 20 rows) vs dequantised torch."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(20, 512, device=device, generator=g)
    b = (torch.randn(256, 512, device=device, generator=g) * 50).to(FP8_DTYPE)
    b_s = torch.rand(2, 4, device=device, generator=g) + 0.5
    # the torch quantisation, in the column-major scale layout: no Triton kernel compiles during the kernel
    # choice (engine/runner/triton_precompile.py records the prefill kernels only while none has)
    aq, a_s = per_token_group_quant_fp8_ref(a)
    a_s = a_s.t().contiguous().t()
    got = cublas_block_fp8_matmul(aq, a_s, b, b_s, torch.bfloat16).float()
    ref = block_fp8_matmul_ref(a, b, b_s, out_dtype=torch.float32)
    err = ((got - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        _CUBLAS_STATE["why"] = f"probe error {err:.3g}"
    return err < 1e-2


def cublas_block_fp8_matmul(aq, a_scale, b_fp8, b_scale, out_dtype=torch.bfloat16, out=None):
    """aq [M, K] e4m3 with 1x128 scales a_scale [M, K/128] @ (b [N, K] e4m3 with 128x128 scales
    [ceil(N/128), K/128]).T through cuBLASLt (torch._scaled_mm); K % 512 == 0 (see
    cublas_block_fp8_supported). M is padded to a multiple of 4; a's scales go column-major."""
    m, k = aq.shape
    pad_m = -m % 4
    if pad_m:
        aq = torch.cat([aq, aq.new_zeros((pad_m, k))])
        a_scale = torch.cat([a_scale, a_scale.new_ones((pad_m, a_scale.shape[1]))])
    if a_scale.stride(0) != 1:
        a_scale = a_scale.t().contiguous().t()
    res = torch._scaled_mm(aq, b_fp8.t(), scale_a=a_scale, scale_b=b_scale.contiguous().t(), out_dtype=out_dtype)
    res = res[:m] if pad_m else res
    if out is not None:
        out.copy_(res)
        return out
    return res


def _block_gemm(a, a_s, b_fp8, b_scale, block, out_dtype, cfg, out):
    """Launch the block GEMM; a_s None means a is bf16/fp32, quantised inside the kernel."""
    bn, bk = block
    m, k = a.shape
    n = b_fp8.shape[0]
    if b_fp8.shape[1] != k:
        raise ValueError(f"a has K={k}, b has K={b_fp8.shape[1]}")
    if tuple(b_scale.shape) != block_scale_shape((n, k), block):
        raise ValueError(f"b_scale shape {tuple(b_scale.shape)} != {block_scale_shape((n, k), block)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif tuple(out.shape) != (m, n):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(m, n)}")
    if m == 0 or n == 0:
        return out
    quant_a = a_s is None
    block_m, block_n = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    block_k = bk if quant_a else min(cfg["BLOCK_SIZE_K"], bk)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split, partials, counts = plan(tiles, cdiv(k, block_k), cfg, block_m, block_n, out)
    _block_fp8_gemm_kernel[(tiles, split)](
        a, a if quant_a else a_s, b_fp8, b_scale, out, partials, counts, m, n, k,
        a.stride(0), a.stride(1), *((0, 0) if quant_a else (a_s.stride(0), a_s.stride(1))),
        b_fp8.stride(0), b_fp8.stride(1), b_scale.stride(0), b_scale.stride(1), out.stride(0), out.stride(1),
        GROUP_N=bn, GROUP_K=bk, QUANT_A=quant_a, BLOCK_SIZE_M=block_m,
        BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=cfg.get("GROUP_SIZE_M", 1), SPLIT_K=split,
        EXACT_ROUND=interpreting(), num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        **launch_options())
    return out


def fp8_bmm(a: torch.Tensor, b_fp8: torch.Tensor, b_scale: torch.Tensor, block: tuple[int, int] = (128, 128),
            out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            block_m: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Batched FP8 matmul for the absorbed MLA weights: out[h] = a[h] @ B[h].

    a [H, M, K] bf16/fp32, any strides (e.g. q_nope.transpose(0, 1)); quantised inside
    the kernel, 1 x block[0] groups along K. b_fp8 [H, K, N] e4m3, any strides (W_UK as
    [H, 128, 512], W_UV as [H, 512, 128], e.g. transposed views of kv_b_proj). b_scale is
    float32 and one of: [] or [1] (per tensor), [H] (per head), or [H, ceil(K/bk), ceil(N/bn)]
    (128 x 128 blocks in B's [K, N] orientation: the checkpoint's kv_b_proj
    `weight_scale_inv` rows for head h, transposed for W_UV, keep the exact fp8 values).
    `out` may be a strided [H, M, N] view (e.g. a [M, H, N] buffer transposed).
    """
    h, m, k = a.shape
    hb, kb_, n = b_fp8.shape
    if (hb, kb_) != (h, k):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b_fp8.shape)} do not match")
    s = _bmm_scale_3d(b_scale, h)
    scale_bk = block[0] if s.shape[1] > 1 else max(k, 1)
    scale_bn = block[1] if s.shape[2] > 1 else max(n, 1)
    if s.shape[1] > 1 and s.shape[1] != cdiv(k, block[0]) or s.shape[2] > 1 and s.shape[2] != cdiv(n, block[1]):
        raise ValueError(f"block scale shape {tuple(b_scale.shape)} does not fit K={k}, N={n}")
    if out is None:
        out = torch.empty((h, m, n), dtype=out_dtype or a.dtype, device=a.device)
    if h == 0 or m == 0 or n == 0:
        return out
    bm = block_m or (16 if m <= 16 else 32)  # tiles measured on an H100 (docs/perf.md)
    block_n = block_n or (64 if m <= 16 else 128)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, block_n), h)
    _fp8_bmm_kernel[grid](
        a, b_fp8, s, out, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b_fp8.stride(0), b_fp8.stride(1), b_fp8.stride(2),
        s.stride(0), s.stride(1), s.stride(2), out.stride(0), out.stride(1), out.stride(2),
        SCALE_BK=scale_bk, SCALE_BN=scale_bn, EXACT_ROUND=interpreting(),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block[0], num_warps=4, num_stages=3, **launch_options())
    return out
