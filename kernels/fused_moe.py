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
What this kernel shares with the W4AFP8 one (kernels/fused_moe_w4a8.py): the prologue, the sum, the
GEMM tiles' rows and epilogue, the launch and the config split, in kernels/moe_common.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import per_token_group_quant_fp8, quant_tile
from kernels.fp8_math import FP8_DTYPE, block_scale_shape, dequant_block_fp8, dequant_groups, quantize_groups
from kernels.moe_align import moe_align_block_size
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
from kernels.split_k import arrive, k_range, plan, sum_slots, tile_slots
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
        stride_cm, stride_cn, ws_ptr, count_ptr,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, USE_FP8: tl.constexpr,
        QUANT_A: tl.constexpr, INTERPRET: tl.constexpr,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
        GROUP_SIZE_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):
    """One [BLOCK_M rows of one expert] x [BLOCK_N output columns] tile.

    Row r of the block is assignment sorted_ids[r] (flat t * top_k + slot); it reads
    A row sorted_ids[r] // A_ROW_DIV and writes C row sorted_ids[r].
    GATED: B rows [n] (gate) and [up_offset + n] (up) are accumulated side by side and
    the tile stores silu(gate) * up.
    SPLIT_K > 1: program (tile, s) sums the s-th of SPLIT_K runs of K blocks (gate and up in two slots of
    ws), and the last of the tile's programs to arrive adds them and runs the epilogue (kernels/split_k.py).
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(npp_ptr):
        return

    rid, r_mask, expert = tile_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_valid, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_rows = rid // A_ROW_DIV

    k_first, k_end = k_range(K, BLOCK_SIZE_K, SPLIT_K, split)
    offs_kf = k_first * BLOCK_SIZE_K + offs_k
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_kf[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + offs_kf[:, None] * stride_bk
    up_ptrs = b_ptrs + up_offset * stride_bn
    if USE_FP8 and not QUANT_A:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
    if USE_FP8:
        bs_ptrs = b_scale_ptr + expert * stride_bse + (cols // GROUP_N) * stride_bsn
        bs_up_ptrs = b_scale_ptr + expert * stride_bse + ((cols + up_offset) // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(k_first, k_end):
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

    if SPLIT_K == 1:
        gemm_epilogue(acc, acc_up, c_ptr, topk_w_ptr, rid, r_mask, offs_n, N, stride_cm, stride_cn,
                      GATED, MUL_WEIGHT, INTERPRET)
    else:
        tile_elems: tl.constexpr = BLOCK_SIZE_M * BLOCK_SIZE_N
        slots = tile_slots(ws_ptr, pid, SPLIT_K * (2 if GATED else 1), BLOCK_SIZE_M, BLOCK_SIZE_N)
        tl.store(slots + split * tile_elems, acc)
        if GATED:
            tl.store(slots + (SPLIT_K + split) * tile_elems, acc_up)
        if arrive(count_ptr, pid, SPLIT_K):
            total = sum_slots(slots, 0, SPLIT_K, BLOCK_SIZE_M, BLOCK_SIZE_N)
            total_up = total
            if GATED:
                total_up = sum_slots(slots, SPLIT_K, SPLIT_K, BLOCK_SIZE_M, BLOCK_SIZE_N)
            gemm_epilogue(total, total_up, c_ptr, topk_w_ptr, rid, r_mask, offs_n, N, stride_cm, stride_cn,
                          GATED, MUL_WEIGHT, INTERPRET)


# --------------------------------------------------------------------------- wrapper


def _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, block_shape):
    t, k = x.shape
    e, two_n, k1 = w13.shape
    n = two_n // 2
    if k1 != k or two_n % 2 or tuple(w2.shape) != (e, k, n):
        raise ValueError(f"shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    check_routing(t, topk_ids, topk_weights)
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


def _launch_gemm(a, a_s, b, b_s, c, topk_w, al, *, fp8, block_shape, cfg, **gemm):
    """kernels.moe_common.launch_gemm of `_moe_gemm_kernel` (`gemm`: its shape arguments).
    a_s None with fp8 weights: a is bf16/fp32 and is quantised inside the GEMM."""
    quant_a = fp8 and a_s is None
    bk = cfg["BLOCK_SIZE_K"]
    if fp8:
        bk = block_shape[1] if quant_a else min(bk, block_shape[1])
    tiles = al.expert_ids.shape[0] * triton.cdiv(gemm["n_out"], cfg["BLOCK_SIZE_N"])
    split, ws, counts = plan(tiles, triton.cdiv(gemm["k"], bk), cfg, al.block_m, cfg["BLOCK_SIZE_N"], c,
                             slots_per_part=2 if gemm["gated"] else 1)
    launch_gemm(_moe_gemm_kernel, a, a_s, b, b_s if fp8 else None, c, topk_w, al, block_k=bk, cfg=cfg, **gemm,
                split_k=split, ws_ptr=ws, count_ptr=counts, SPLIT_K=split,
                USE_FP8=fp8, QUANT_A=quant_a, GROUP_N=block_shape[0], GROUP_K=block_shape[1])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, block_shape=(128, 128),
              config: Optional[dict] = None, out: Optional[torch.Tensor] = None,
              config_experts: Optional[int] = None) -> torch.Tensor:
    """Routed-experts output [T, K] in x.dtype (see the module docstring).

    FP8: w13/w2 float8_e4m3fn with float32 scales [E, ceil(2N/128), ceil(K/128)] and
    [E, ceil(K/128), ceil(N/128)] (block_shape (128, 128)). `config` (BLOCK_SIZE_M/N/K,
    GROUP_SIZE_M, num_warps, num_stages) defaults to the tuned file for (E, N, device)
    at the batch size nearest T. Optional keys: QUANT_A=1 quantises the activations inside
    the GEMM tiles instead of a separate pass (FP8 only; fewer launches, slower on an H100);
    `<KEY>_DOWN` overrides <KEY> for the down-projection GEMM (BLOCK_SIZE_M is shared by both).
    `out` ([T, K], x.dtype) receives the result if given. `config_experts`: the expert count the tuned
    files are looked up by, when it is not w13's (the routed experts, with shared ones appended).
    """
    t, k, e, n = _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, block_shape)
    inp = moe_inputs(x, topk_ids, topk_weights, out)
    if inp.empty:
        return inp.out.zero_()
    fp8 = w13.dtype == FP8_DTYPE
    cfg = config or get_moe_config(config_experts or e, n, t, inp.top_k, moe_dtype_name(w13.dtype), device=x.device)
    up_cfg, down_cfg = split_config(cfg)

    if fp8 and not up_cfg.get("QUANT_A", 0):  # else no quantisation, or the GEMM quantises its own A tiles
        al, a1, a1_s = align_and_quant(inp.x, inp.ids, e, cfg["BLOCK_SIZE_M"], block_shape[1])
    else:
        al, a1, a1_s = moe_align_block_size(inp.ids, cfg["BLOCK_SIZE_M"], e), inp.x, None
    h = torch.empty((inp.num_valid, n), dtype=inp.inter_dtype, device=x.device)
    _launch_gemm(a1, a1_s, w13, w13_scale, h, inp.weights, al, fp8=fp8, block_shape=block_shape, cfg=up_cfg,
                 **inp.up_gemm(n, k))

    a2, a2_s = h, None
    if fp8 and not down_cfg.get("QUANT_A", 0):
        a2, a2_s = per_token_group_quant_fp8(h, block_shape[1])
    y = torch.empty((inp.num_valid, k), dtype=inp.inter_dtype, device=x.device)
    _launch_gemm(a2, a2_s, w2, w2_scale, y, inp.weights, al, fp8=fp8, block_shape=block_shape, cfg=down_cfg,
                 **inp.down_gemm(n, k))
    return moe_sum(y, inp, e)


__all__ = ["fused_moe", "fused_moe_ref"]
