"""What the two fused-MoE kernels share: kernels/fused_moe.py (bf16 / FP8 W8A8 experts) and
kernels/fused_moe_w4a8.py (INT4 experts x FP8 activations).

Each has its own grouped GEMM kernel (the K loop differs); both take the positional arguments of
`launch_gemm` and use `tile_rows` / `gemm_epilogue` for the routed rows of a tile and for what a tile
stores. Around the GEMMs the steps are the same: `moe_inputs` (contiguous inputs, intermediate
dtype), `split_config` (the up and down GEMMs' configs), `align_and_quant` (routing alignment + x in
e4m3, one launch for decode sizes), `moe_sum` (sum over top_k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.fp8 import check_deinterleave, groups_per_program, per_token_group_quant_fp8, quant_groups, store_cast
from kernels.fp8_math import FP8_DTYPE
from kernels.interpret import interpreting
from kernels.moe_align import MoEAlignment, align_plan, align_small, moe_align_block_size
from kernels.pdl import launch_options, pdl_enter

# --------------------------------------------------------------------------- GEMM tile pieces


@triton.jit
def tile_rows(sorted_ids_ptr, expert_ids_ptr, pid_m, num_valid, BLOCK_SIZE_M: tl.constexpr):
    """Row block pid_m of the aligned routing -> (rid, r_mask, expert): row r is assignment rid[r]
    (flat t * top_k + slot; 0 where r_mask is off, the block's padding), all of them for `expert`."""
    offs_r = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    rid = tl.load(sorted_ids_ptr + offs_r)
    r_mask = rid < num_valid
    rid = tl.where(r_mask, rid, 0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return rid, r_mask, expert


@triton.jit
def gemm_epilogue(acc, acc_up, c_ptr, topk_w_ptr, rid, r_mask, offs_n, N, stride_cm, stride_cn,
                  GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the fp32 tile into C rows rid: silu(acc) * acc_up if GATED, times the row's routing weight
    if MUL_WEIGHT, cast to C's dtype."""
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + rid, mask=r_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + rid[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, store_cast(acc, c_ptr, INTERPRET), mask=r_mask[:, None] & (offs_n[None, :] < N))


def launch_gemm(kernel, a, a_s, b, b_s, c, topk_w, al: MoEAlignment, *, n_out, k, num_valid, up_offset,
                a_row_div, gated, mul_weight, block_k, cfg, split_k=1, **meta):
    """One grouped GEMM: C[rid] = A[rid // a_row_div] @ B[expert]^T (see `gemm_epilogue`).

    `kernel` takes the positional arguments below and these constexprs; `meta` adds its own (a split-K
    kernel its scratch, counts and SPLIT_K; `split_k` is the grid's second axis). a_s / b_s None: no
    scales (A, B in their place, strides 0)."""
    bn = cfg["BLOCK_SIZE_N"]
    npm = al.expert_ids.shape[0]
    a_s_strides = (a_s.stride(0), a_s.stride(1)) if a_s is not None else (0, 0)
    b_s_strides = b_s.stride() if b_s is not None else (0, 0, 0)
    kernel[(npm * triton.cdiv(n_out, bn), split_k)](
        a, a if a_s is None else a_s, b, b if b_s is None else b_s, c, topk_w,
        al.sorted_ids, al.expert_ids, al.num_post_pad,
        n_out, k, num_valid, npm, up_offset,
        a.stride(0), a.stride(1), *a_s_strides,
        b.stride(0), b.stride(1), b.stride(2), *b_s_strides,
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, INTERPRET=interpreting(),
        BLOCK_SIZE_M=al.block_m, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=block_k, GROUP_SIZE_M=cfg.get("GROUP_SIZE_M", 1),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **meta, **launch_options())


# --------------------------------------------------------------------------- around the GEMMs


@dataclass(frozen=True)
class MoEInputs:
    """A fused-MoE call's inputs as the kernels read them, and its output."""
    x: torch.Tensor  # [T, K], last dim contiguous
    ids: torch.Tensor  # [T * top_k] expert ids, contiguous
    weights: torch.Tensor  # [T, top_k] routing weights, contiguous
    top_k: int
    out: torch.Tensor  # [T, K] in x.dtype

    @property
    def empty(self) -> bool:
        """No token or no slot: the output is zeros and nothing is launched."""
        return self.x.shape[0] == 0 or self.top_k == 0

    @property
    def num_valid(self) -> int:
        """Assignments (token, slot): the rows of the intermediates."""
        return self.ids.numel()

    @property
    def inter_dtype(self) -> torch.dtype:
        """The intermediates' dtype ([T * top_k, N] after gate_up, [T * top_k, K] after down)."""
        return self.x.dtype if self.x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16

    def up_gemm(self, n: int, k: int) -> dict:
        """`launch_gemm`'s shape arguments for gate_up: x rows [K] -> silu(gate) * up [N] per assignment."""
        return dict(n_out=n, k=k, num_valid=self.num_valid, up_offset=n, a_row_div=self.top_k, gated=True,
                    mul_weight=False)

    def down_gemm(self, n: int, k: int) -> dict:
        """`launch_gemm`'s shape arguments for down: [N] -> [K] x routing weight per assignment."""
        return dict(n_out=k, k=n, num_valid=self.num_valid, up_offset=0, a_row_div=1, gated=False, mul_weight=True)


def check_routing(t: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """topk_ids and topk_weights must both be [T, top_k] (ValueError naming the shapes otherwise)."""
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} vs T={t}")


def moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> MoEInputs:
    """The inputs made contiguous where the kernels need it; `out` if given, else a new [T, K] tensor."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return MoEInputs(x if x.stride(-1) == 1 else x.contiguous(), topk_ids.contiguous().reshape(-1),
                     topk_weights.contiguous(), topk_ids.shape[1], out)


def split_config(cfg: dict) -> tuple[dict, dict]:
    """(gate_up GEMM's config, down GEMM's config): `cfg` without its `<KEY>_DOWN` entries, and `cfg` with
    them taking over <KEY>."""
    up = {k: v for k, v in cfg.items() if not k.endswith("_DOWN")}
    return up, {**up, **{k[:-5]: v for k, v in cfg.items() if k.endswith("_DOWN")}}


@triton.jit
def _moe_prologue_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                         x_ptr, q_ptr, s_ptr, sum_ptr, K, stride_xm, stride_qm, stride_sm, n_gblk,
                         CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
                         FILL: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                         EXACT_ROUND: tl.constexpr, DEINTERLEAVE: tl.constexpr = False, SUMS: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """One launch for two independent jobs: program 0 aligns the routing (small inputs), the
    others quantise x in 1 x GROUP groups for the gate_up GEMM."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        align_small(ids_ptr, sorted_ids_ptr, expert_ids_ptr, npp_ptr, n_chunks, E, numel, n_blocks,
                    CHUNK, BLOCK_M, BLOCK_E, BLOCK_B, FILL)
    else:
        r = pid - 1
        quant_groups(x_ptr, q_ptr, s_ptr, r // n_gblk, r % n_gblk, K, stride_xm, stride_qm, stride_sm, 1,
                     1e-10, GROUP, GROUPS_PER_PROG, EXACT_ROUND, DEINTERLEAVE, sum_ptr, SUMS)


def align_and_quant(x: torch.Tensor, ids: torch.Tensor, num_experts: int, block_m: int, group: int,
                    deinterleave: bool = False, sums: bool = False) -> tuple:
    """(MoEAlignment of ids [T * top_k], x [T, K] in e4m3, its 1 x group scales[, the groups' sums]): one
    launch (the prologue) for decode-sized routings, else the alignment's launches and a quantisation.
    `deinterleave`: x's columns in kernels.fp8_math.deinterleave_groups order (whole groups only); `sums`: as
    kernels.fp8.per_token_group_quant_fp8's."""
    plan = align_plan(ids.numel(), num_experts, block_m)
    if not plan.small:
        return (moe_align_block_size(ids, block_m, num_experts),
                *per_token_group_quant_fp8(x, group, deinterleave=deinterleave, sums=sums))
    t, k = x.shape
    check_deinterleave(k, group, deinterleave)
    g = triton.cdiv(k, group)
    al = plan.empty(x.device)
    xq = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((t, g), dtype=torch.float32, device=x.device)
    total = torch.empty((t, g), dtype=torch.float32, device=x.device) if sums else xs
    gpp = groups_per_program(g, group)
    n_gblk = triton.cdiv(g, gpp)
    _moe_prologue_kernel[(1 + t * n_gblk,)](
        ids, al.sorted_ids, al.expert_ids, al.num_post_pad, plan.n_chunks, plan.num_experts, plan.numel,
        plan.n_blocks, x, xq, xs, total, k, x.stride(0), xq.stride(0), xs.stride(0), n_gblk,
        **plan.meta(), GROUP=group, GROUPS_PER_PROG=gpp, EXACT_ROUND=interpreting(), DEINTERLEAVE=deinterleave,
        SUMS=sums, num_warps=4, **launch_options())
    return (al, xq, xs, total) if sums else (al, xq, xs)


@triton.jit
def _moe_sum_kernel(y_ptr, ids_ptr, out_ptr, K, E, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    EXACT_ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum over slots s with a valid expert id of y[t * TOP_K + s]."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + s)
        if (e >= 0) & (e < E):
            acc += tl.load(y_ptr + (t * TOP_K + s) * K + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * K + cols, store_cast(acc, out_ptr, EXACT_ROUND), mask=mask)


def moe_sum(y: torch.Tensor, inputs: MoEInputs, num_experts: int) -> torch.Tensor:
    """inputs.out [T, K] = sum over the slots with an id in [0, num_experts) of y [T * top_k, K] (contiguous)."""
    out = inputs.out
    t, k = out.shape
    block = min(1024, triton.next_power_of_2(k))
    _moe_sum_kernel[(t, triton.cdiv(k, block))](y, inputs.ids, out, k, num_experts, TOP_K=inputs.top_k,
                                                  BLOCK=block, EXACT_ROUND=interpreting(), num_warps=4,
                                                  **launch_options())
    return out


__all__ = ["MoEInputs", "align_and_quant", "check_routing", "gemm_epilogue", "launch_gemm", "moe_inputs", "moe_sum",
           "split_config", "tile_rows"]
