"""Fused MoE (routed experts): align, grouped GEMM gate_up + SiLU*up, grouped GEMM down x routing weight, sum.

  fused_moe(x [T, K], w13 [E, 2N, K] (gate rows, then up rows), w2 [E, K, N],
            topk_ids [T, top_k], topk_weights [T, top_k]) -> [T, K]
  out[t] = sum_s w[t, s] * W2[e] @ (silu(G[e] @ x[t]) * (U[e] @ x[t])),  e = topk_ids[t, s]

Weights in bf16/fp16/fp32, or float8_e4m3fn with 128 x 128 block scales (W8A8: the
activations are quantised on the fly, 1 x 128 groups, before each GEMM; fp32
accumulation). Steps (no host sync, CUDA-graph safe):
  moe_align_block_size -> [quant x] -> GEMM1 (gate and up accumulated side by side,
  SiLU*up in the epilogue, [T*top_k, N]) -> [quant] -> GEMM2 (x routing weight,
  [T*top_k, K]) -> sum over top_k.
For decode-sized batches the alignment is one program and shares its launch with the
quantisation of x (the prologue): 5 launches in all. Configs may set QUANT_A (the GEMMs
quantise their own A tiles, saving the quant launches); on an H100 that was slower, so
the shipped configs keep it off (docs/perf.md).
Ids outside [0, E) (experts owned by another EP rank) contribute nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import groups_per_program, per_token_group_quant_fp8, quant_groups, quant_tile, store_cast
from kernels.fp8_math import FP8_DTYPE, block_scale_shape, dequant_block_fp8, dequant_groups, quantize_groups
from kernels.interpret import interpreting
from kernels.moe_align import align_plan, align_small, moe_align_block_size
from kernels.tile_order import grouped_tile
from kernels.tuned_configs import get_moe_config, moe_dtype_name

# --------------------------------------------------------------------------- reference


def _dequant_expert(w: torch.Tensor, s: Optional[torch.Tensor], block) -> torch.Tensor:
    if w.dtype != FP8_DTYPE:
        return w.float()
    return dequant_block_fp8(w, s, block)


def _act_quant(x: torch.Tensor, fp8: bool, block_k: int) -> torch.Tensor:
    if not fp8:
        return x.float()
    q, s = quantize_groups(x, block_k)
    return dequant_groups(q, s, block_k)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None, block_shape=(128, 128),
                  compute_dtype: torch.dtype = torch.float32, quantize: bool = True) -> torch.Tensor:
    """Loop over experts. Mirrors the kernel's roundings (activation quantisation, intermediate
    stored in x.dtype) when `quantize`; with quantize=False and compute_dtype=float64 it is the
    exact maths the FP8 kernel approximates (dequantised weights, unquantised activations)."""
    t, k = x.shape
    n = w2.shape[2]
    fp8 = w13.dtype == FP8_DTYPE
    out = torch.zeros((t, k), dtype=compute_dtype, device=x.device)
    ids = topk_ids.long()
    xa = _act_quant(x, fp8 and quantize, block_shape[1]).to(compute_dtype)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        g13 = _dequant_expert(w13[e], w13_scale[e] if fp8 else None, block_shape).to(compute_dtype)
        g2 = _dequant_expert(w2[e], w2_scale[e] if fp8 else None, block_shape).to(compute_dtype)
        h = xa[tok] @ g13.T
        act = F.silu(h[:, :n]) * h[:, n:]
        if quantize:
            act = _act_quant(act.to(x.dtype), fp8, block_shape[1]).to(compute_dtype)
        y = (act @ g2.T) * topk_weights[tok, slot, None].to(compute_dtype)
        if quantize:
            y = y.to(x.dtype).to(compute_dtype)
        out.index_add_(0, tok, y)
    return out if compute_dtype == torch.float64 else out.to(x.dtype)


# --------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["num_valid", "num_pid_m"])
def _moe_gemm_kernel(
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_w_ptr,
        sorted_ids_ptr, expert_ids_ptr, npp_ptr,
        N, K, num_valid, num_pid_m, up_offset,
        stride_am, stride_ak, stride_asm, stride_ask,
        stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
        stride_cm, stride_cn,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, USE_FP8: tl.constexpr,
        QUANT_A: tl.constexpr, INTERPRET: tl.constexpr,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr):
    """One [BLOCK_M rows of one expert] x [BLOCK_N output columns] tile.

    Row r of the block is assignment sorted_ids[r] (flat t * top_k + slot); it reads
    A row sorted_ids[r] // A_ROW_DIV and writes C row sorted_ids[r].
    GATED: B rows [n] (gate) and [up_offset + n] (up) are accumulated side by side and
    the tile stores silu(gate) * up.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(npp_ptr):
        return

    offs_r = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    rid = tl.load(sorted_ids_ptr + offs_r)
    r_mask = rid < num_valid
    rid = tl.where(r_mask, rid, 0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_rows = rid // A_ROW_DIV

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    up_ptrs = b_ptrs + up_offset * stride_bn
    if USE_FP8 and not QUANT_A:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
    if USE_FP8:
        bs_ptrs = b_scale_ptr + expert * stride_bse + (cols // GROUP_N) * stride_bsn
        bs_up_ptrs = b_scale_ptr + expert * stride_bse + ((cols + up_offset) // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - kk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=r_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if GATED:
            b_up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if USE_FP8:
            kg = (kk * BLOCK_SIZE_K) // GROUP_K
            if QUANT_A:  # A is bf16/fp32: quantise this 1 x GROUP_K tile here (BLOCK_SIZE_K == GROUP_K)
                aq, a_s = quant_tile(a.to(tl.float32), INTERPRET)
                a = aq.to(b.dtype)
            else:
                a_s = tl.load(as_ptrs + kg * stride_ask, mask=r_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            if GATED:
                b_s_up = tl.load(bs_up_ptrs + kg * stride_bsk)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * b_s_up[None, :]
        elif INTERPRET:  # CPU interpreter: its bf16 dot is wrong, an fp32 dot of bf16 values is exact
            a = a.to(tl.float32)
            acc = tl.dot(a, b.to(tl.float32), acc)
            if GATED:
                acc_up = tl.dot(a, b_up.to(tl.float32), acc_up)
        else:
            a = a.to(b.dtype)
            acc = tl.dot(a, b, acc)
            if GATED:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
        up_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + rid, mask=r_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + rid[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, store_cast(acc, c_ptr, INTERPRET), mask=r_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _moe_prologue_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                         x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, n_gblk,
                         CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                         FILL: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                         EXACT_ROUND: tl.constexpr):
    """One launch for two independent jobs: program 0 aligns the routing (small inputs), the
    others quantise x for the gate_up GEMM."""
    pid = tl.program_id(0)
    if pid == 0:
        align_small(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                    CHUNK, BLOCK_M, BLOCK_E, BLOCK_B, FILL)
    else:
        r = pid - 1
        quant_groups(x_ptr, q_ptr, s_ptr, r // n_gblk, r % n_gblk, K, stride_xm, stride_qm, stride_sm, 1,
                     1e-10, GROUP, GROUPS_PER_PROG, EXACT_ROUND)


def _prologue(x, ids, plan, group):
    """Alignment + 1 x group quantisation of x in one launch -> (MoEAlignment, xq, x_scale)."""
    t, k = x.shape
    g = triton.cdiv(k, group)
    al = plan.empty(x.device)
    xq = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((t, g), dtype=torch.float32, device=x.device)
    gpp = groups_per_program(g, group)
    n_gblk = triton.cdiv(g, gpp)
    _moe_prologue_kernel[(1 + t * n_gblk,)](
        ids, al.sorted_ids, al.expert_ids, al.num_post_pad, plan.n_chunks, plan.num_experts, plan.numel,
        plan.n_blocks, x, xq, xs, k, x.stride(0), xq.stride(0), xs.stride(0), n_gblk,
        **plan.meta(), GROUP=group, GROUPS_PER_PROG=gpp, EXACT_ROUND=interpreting(), num_warps=4)
    return al, xq, xs


@triton.jit
def _moe_sum_kernel(y_ptr, ids_ptr, out_ptr, K, E, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    EXACT_ROUND: tl.constexpr):
    """out[t] = sum over slots s with a valid expert id of y[t * TOP_K + s]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + s)
        if (e >= 0) & (e < E):
            acc += tl.load(y_ptr + (t * TOP_K + s) * K + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * K + cols, store_cast(acc, out_ptr, EXACT_ROUND), mask=mask)


# --------------------------------------------------------------------------- wrapper


def _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, block_shape):
    t, k = x.shape
    e, two_n, k1 = w13.shape
    n = two_n // 2
    if k1 != k or two_n % 2 or tuple(w2.shape) != (e, k, n):
        raise ValueError(f"shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} vs T={t}")
    if (w13.dtype == FP8_DTYPE) != (w2.dtype == FP8_DTYPE):
        raise ValueError("w13 and w2 must both be FP8 or both not")
    if w13.dtype == FP8_DTYPE:
        bk = block_shape[1]
        want13, want2 = block_scale_shape(w13.shape, block_shape), block_scale_shape(w2.shape, block_shape)
        if w13_scale is None or w2_scale is None or tuple(w13_scale.shape) != want13 \
                or tuple(w2_scale.shape) != want2:
            raise ValueError(f"FP8 weights need w13_scale {want13} and w2_scale {want2}")
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"block_shape {block_shape}: the K block must be a power of two >= 16")
    return t, k, e, n


def _launch_gemm(a, a_s, b, b_s, c, topk_w, al, *, n_out, k, num_valid, up_offset, a_row_div, gated,
                 mul_weight, fp8, block_shape, cfg):
    """a_s None with fp8 weights: a is bf16/fp32 and is quantised inside the GEMM."""
    bn_, bk = cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    quant_a = fp8 and a_s is None
    if fp8:
        bk = block_shape[1] if quant_a else min(bk, block_shape[1])
    npm = al.expert_ids.shape[0]
    grid = (npm * triton.cdiv(n_out, bn_),)
    a_strides = (a_s.stride(0), a_s.stride(1)) if fp8 and not quant_a else (0, 0)
    _moe_gemm_kernel[grid](
        a, a_s if a_s is not None else a, b, b_s if fp8 else b, c, topk_w,
        al.sorted_ids, al.expert_ids, al.num_post_pad,
        n_out, k, num_valid, npm, up_offset,
        a.stride(0), a.stride(1), *a_strides,
        b.stride(0), b.stride(1), b.stride(2), *(b_s.stride() if fp8 else (0, 0, 0)),
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, USE_FP8=fp8, QUANT_A=quant_a,
        INTERPRET=interpreting(), GROUP_N=block_shape[0], GROUP_K=block_shape[1],
        BLOCK_SIZE_M=al.block_m, BLOCK_SIZE_N=bn_, BLOCK_SIZE_K=bk, GROUP_SIZE_M=cfg.get("GROUP_SIZE_M", 1),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))


def _down_config(cfg: dict) -> dict:
    """The down-projection GEMM's config: `cfg` with any `<KEY>_DOWN` entries taking over <KEY>."""
    down = {k: v for k, v in cfg.items() if not k.endswith("_DOWN")}
    down.update({k[:-5]: v for k, v in cfg.items() if k.endswith("_DOWN")})
    return down


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, block_shape=(128, 128),
              config: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed-experts output [T, K] in x.dtype (see the module docstring).

    FP8: w13/w2 float8_e4m3fn with float32 scales [E, ceil(2N/128), ceil(K/128)] and
    [E, ceil(K/128), ceil(N/128)] (block_shape (128, 128)). `config` (BLOCK_SIZE_M/N/K,
    GROUP_SIZE_M, num_warps, num_stages) defaults to the tuned file for (E, N, device)
    at the batch size nearest T. Optional keys: QUANT_A=1 quantises the activations inside
    the GEMM tiles instead of a separate pass (FP8 only; fewer launches, slower on an H100);
    `<KEY>_DOWN` overrides <KEY> for the down-projection GEMM (BLOCK_SIZE_M is shared by both).
    `out` ([T, K], x.dtype) receives the result if given.
    """
    t, k, e, n = _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, block_shape)
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((t, k), dtype=x.dtype, device=x.device)
    if t == 0 or top_k == 0:
        return out.zero_()
    fp8 = w13.dtype == FP8_DTYPE
    cfg = config or get_moe_config(e, n, t, top_k, moe_dtype_name(w13.dtype), device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    num_valid = t * top_k
    inter_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16

    up_cfg = {k_: v for k_, v in cfg.items() if not k_.endswith("_DOWN")}
    down_cfg = _down_config(cfg)

    def act(a, c):  # separate activation quantisation unless the GEMM quantises its own tiles
        if not fp8 or c.get("QUANT_A", 0):
            return a, None
        return per_token_group_quant_fp8(a, block_shape[1])

    plan = align_plan(num_valid, e, cfg["BLOCK_SIZE_M"])
    if fp8 and plan.small and not up_cfg.get("QUANT_A", 0):
        al, a1, a1_s = _prologue(x, ids.reshape(-1), plan, block_shape[1])
    else:
        al = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e)
        a1, a1_s = act(x, up_cfg)
    h = torch.empty((num_valid, n), dtype=inter_dtype, device=x.device)
    _launch_gemm(a1, a1_s, w13, w13_scale, h, weights, al, n_out=n, k=k, num_valid=num_valid, up_offset=n,
                 a_row_div=top_k, gated=True, mul_weight=False, fp8=fp8, block_shape=block_shape, cfg=up_cfg)

    a2, a2_s = act(h, down_cfg)
    y = torch.empty((num_valid, k), dtype=inter_dtype, device=x.device)
    _launch_gemm(a2, a2_s, w2, w2_scale, y, weights, al, n_out=k, k=n, num_valid=num_valid, up_offset=0,
                 a_row_div=1, gated=False, mul_weight=True, fp8=fp8, block_shape=block_shape, cfg=down_cfg)

    block = min(1024, triton.next_power_of_2(k))
    _moe_sum_kernel[(t, triton.cdiv(k, block))](y, ids, out, k, e, TOP_K=top_k, BLOCK=block,
                                                  EXACT_ROUND=interpreting(), num_warps=4)
    return out


__all__ = ["fused_moe", "fused_moe_ref"]
