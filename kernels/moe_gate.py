"""MoE router: fused grouped top-k over router logits (DeepSeek V2/V3 gate methods).

  moe_gate(logits [T, E] or hidden [T, H] + gate_weight [E, H], method=..., top_k=...)
      -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int32)

Methods:
- noaux_tc (V3/R1): scores = sigmoid(logits); choice = scores + e_score_correction_bias;
  group score = sum of the top-2 choices of each of n_group groups; keep topk_group
  groups; top-k experts by choice among them; weights = the unbiased scores.
- group_limited_greedy (V2): scores = softmax(logits); group score = max score; keep
  topk_group groups; top-k by score among them.
- greedy (V2-Lite): top-k by softmax score.
Then weights /= their sum if norm_topk_prob (and top_k > 1), and *= routed_scaling_factor.
Ids come out in descending order of the selection key (choice or score); ties go to the
lower expert index. One program handles BLOCK_T tokens x all experts in registers.
With n_shared > 0 every row gets n_shared more columns: ids E .. E + n_shared - 1 with weight 1 (shared experts
appended to the routed ones, engine/model/moe.py), written by the same launch.

From the hidden states with FUSED_MIN_T to FUSED_MAX_T rows (small decode batches), the router's logits are
computed in the same launch (`_router_gate_kernel`): the programs split the experts and the hidden size, each adds its float32
products (x converted in registers, no TF32) into a slot, and the last program to arrive adds the slots in a
fixed order and runs the gate: one launch where a decode step ran three (x.float(), the GEMV, the gate). Where
that does not pay (one row, larger batches; measured) the three launches run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import split_k
from kernels.pdl import launch_options, pdl_enter
from kernels.split_k import arrive

METHODS = {"noaux_tc": 0, "group_limited_greedy": 1, "greedy": 2}


def _logits(x: torch.Tensor, gate_weight: Optional[torch.Tensor]) -> torch.Tensor:
    return x.float() if gate_weight is None else F.linear(x.float(), gate_weight.float())


def _scoring(method: str, scoring_func: Optional[str]) -> str:
    return scoring_func or ("sigmoid" if method == "noaux_tc" else "softmax")


def moe_gate_ref(x: torch.Tensor, gate_weight: Optional[torch.Tensor] = None, *, top_k: int,
                 method: str = "noaux_tc", n_group: int = 1, topk_group: int = 1,
                 correction_bias: Optional[torch.Tensor] = None, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, scoring_func: Optional[str] = None,
                 ids_dtype: torch.dtype = torch.int32, n_shared: int = 0,
                 pad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference for `moe_gate` (same arguments)."""
    logits = _logits(x, gate_weight)
    t, e = logits.shape
    scores = logits.sigmoid() if _scoring(method, scoring_func) == "sigmoid" else logits.softmax(-1)
    if method == "greedy":
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        biased = method == "noaux_tc" and correction_bias is not None
        choice = scores + correction_bias.float() if biased else scores
        groups = choice.view(t, n_group, e // n_group)
        if method == "noaux_tc":
            group_score = groups.topk(min(2, e // n_group), dim=-1).values.sum(-1)
        else:
            group_score = groups.max(-1).values
        keep = group_score.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        emask = gmask.repeat_interleave(e // n_group, dim=1)
        ids = choice.masked_fill(~emask, float("-inf")).topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights, ids = weights * routed_scaling_factor, ids.to(ids_dtype)
    if n_shared:
        shared = torch.arange(e, e + n_shared, dtype=ids_dtype, device=ids.device).expand(t, -1)
        weights = torch.cat((weights, weights.new_ones(t, n_shared)), dim=1)
        ids = torch.cat((ids, shared), dim=1)
    if pad is not None:  # padding rows: no expert (rows past pad's are kept)
        ids[: pad.shape[0]].masked_fill_(pad[:, None], -1)
    return weights, ids


@triton.jit
def _argmax_first(v, idx, BIG: tl.constexpr):
    """Per row: max of v and the lowest index reaching it."""
    m = tl.max(v, axis=1)
    return m, tl.min(tl.where(v == m[:, None], idx[None, :], BIG), axis=1)


@triton.jit
def _gate_rows(x, rows_c, r_mask, bias_ptr, w_ptr, ids_ptr, pad_ptr, P, E, scaling,
               TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
               GROUP_SIZE: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
               HAS_BIAS: tl.constexpr, NORM: tl.constexpr, N_SHARED: tl.constexpr, HAS_PAD: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """The gate of BLOCK_T rows of float32 logits x [BLOCK_T, BLOCK_E] (-inf past E): weights and ids stored; with
    HAS_PAD, the ids of the rows < P that pad (int8 [P], 1: a padding row) marks are -1 (no expert)."""
    e = tl.arange(0, BLOCK_E)
    e_ok = (e < E)[None, :]
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    neg = float("-inf")
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(e_ok, choice, neg)

    if METHOD != 2:
        grp = e // GROUP_SIZE
        g_idx = tl.arange(0, BLOCK_G)
        gscore = tl.full((BLOCK_T, BLOCK_G), neg, tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where((grp == g)[None, :], choice, neg)
            if METHOD == 0 and GROUP_SIZE > 1:
                m1, first = _argmax_first(v, e, BLOCK_E)
                s = m1 + tl.max(tl.where(e[None, :] == first[:, None], neg, v), axis=1)
            else:
                s = tl.max(v, axis=1)
            gscore = tl.where(g_idx[None, :] == g, s[:, None], gscore)
        keep = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _i in tl.static_range(TOPK_GROUP):
            _, gi = _argmax_first(tl.where(keep > 0, neg, gscore), g_idx, BLOCK_G)
            keep = tl.where(g_idx[None, :] == gi[:, None], 1, keep)
        allowed = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for g in tl.static_range(N_GROUP):
            kept = tl.sum(tl.where(g_idx[None, :] == g, keep, 0), axis=1)
            allowed = tl.where((grp == g)[None, :] & (kept[:, None] > 0), 1, allowed)
        choice = tl.where(allowed > 0, choice, neg)

    k_idx = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for i in tl.static_range(TOP_K):
        _, best = _argmax_first(choice, e, BLOCK_E)
        hit = e[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        weights = tl.where(k_idx[None, :] == i, w[:, None], weights)
        ids = tl.where(k_idx[None, :] == i, best[:, None], ids)
        choice = tl.where(hit, neg, choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    if N_SHARED > 0:  # the shared experts' columns: ids E + j, weight 1
        shared = (k_idx >= TOP_K)[None, :]
        weights = tl.where(shared, 1.0, weights)
        ids = tl.where(shared, E + k_idx[None, :] - TOP_K, ids)
    if HAS_PAD:
        padded = tl.load(pad_ptr + rows_c, mask=r_mask & (rows_c < P), other=0)
        ids = tl.where(padded[:, None] != 0, -1, ids)
    out_mask = r_mask[:, None] & (k_idx[None, :] < TOP_K + N_SHARED)
    offs = rows_c[:, None] * (TOP_K + N_SHARED) + k_idx[None, :]
    tl.store(w_ptr + offs, weights, mask=out_mask)
    tl.store(ids_ptr + offs, ids.to(ids_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_gate_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, pad_ptr, P, T, E, stride_lt, scaling,
                     TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, N_SHARED: tl.constexpr, HAS_PAD: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_mask = rows < T
    rows_c = tl.minimum(rows, T - 1).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + rows_c[:, None] * stride_lt + e[None, :], mask=(e < E)[None, :], other=float("-inf"))
    _gate_rows(x.to(tl.float32), rows_c, r_mask, bias_ptr, w_ptr, ids_ptr, pad_ptr, P, E, scaling, TOP_K, N_GROUP,
               TOPK_GROUP, GROUP_SIZE, METHOD, SIGMOID, HAS_BIAS, NORM, N_SHARED, HAS_PAD, BLOCK_T, BLOCK_E, BLOCK_G,
               BLOCK_K)


@triton.jit
def _router_gate_kernel(x_ptr, gw_ptr, ws_ptr, count_ptr, bias_ptr, w_ptr, ids_ptr, pad_ptr, P, T, E, H, stride_xt,
                        stride_ge, scaling,
                        TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, NORM: tl.constexpr, N_SHARED: tl.constexpr, HAS_PAD: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_EW: tl.constexpr, BLOCK_H: tl.constexpr,
                        SPLIT_H: tl.constexpr, PROGRAMS: tl.constexpr, PDL: tl.constexpr = False):
    """Router logits and the gate in one launch: program (expert block b, hidden part s) adds x[:, part s] .
    W[b's experts, part s] in float32 (exact products, no TF32) and stores it to its slot of `ws`
    [SPLIT_H, BLOCK_T, BLOCK_E]; the last program to arrive (kernels/split_k.py's count) adds the parts in order
    0..SPLIT_H-1 into the logits and runs the gate over all T (<= BLOCK_T) rows."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    b = pid // SPLIT_H
    part = pid % SPLIT_H
    rows = tl.arange(0, BLOCK_T)
    r_mask = rows < T
    rows_c = tl.minimum(rows, T - 1).to(tl.int64)
    ex = b * BLOCK_EW + tl.arange(0, BLOCK_EW)
    ex_ok = ex < E
    h_per = tl.cdiv(tl.cdiv(H, BLOCK_H), SPLIT_H) * BLOCK_H
    h_first = part * h_per
    acc = tl.zeros((BLOCK_T, BLOCK_EW), tl.float32)
    for h0 in range(h_first, tl.minimum(h_first + h_per, H), BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        xs = tl.load(x_ptr + rows_c[:, None] * stride_xt + h[None, :], mask=r_mask[:, None] & h_ok[None, :],
                     other=0.0).to(tl.float32)
        ws = tl.load(gw_ptr + ex[:, None].to(tl.int64) * stride_ge + h[None, :],
                     mask=ex_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xs[:, None, :] * ws[None, :, :], axis=2)
    slot = ws_ptr + part * (BLOCK_T * BLOCK_E) + rows[:, None] * BLOCK_E + (b * BLOCK_EW + tl.arange(0, BLOCK_EW))[None, :]
    tl.store(slot, acc)
    if arrive(count_ptr, 0, PROGRAMS):
        e = tl.arange(0, BLOCK_E)
        logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
        for s in tl.static_range(SPLIT_H):
            logits += tl.load(ws_ptr + s * (BLOCK_T * BLOCK_E) + rows[:, None] * BLOCK_E + e[None, :],
                              cache_modifier=".cg")
        logits = tl.where((e < E)[None, :], logits, float("-inf"))
        _gate_rows(logits, rows_c, r_mask, bias_ptr, w_ptr, ids_ptr, pad_ptr, P, E, scaling, TOP_K, N_GROUP,
                   TOPK_GROUP, GROUP_SIZE, METHOD, SIGMOID, HAS_BIAS, NORM, N_SHARED, HAS_PAD, BLOCK_T, BLOCK_E,
                   BLOCK_G, BLOCK_K)


def moe_gate(x: torch.Tensor, gate_weight: Optional[torch.Tensor] = None, *, top_k: int,
             method: str = "noaux_tc", n_group: int = 1, topk_group: int = 1,
             correction_bias: Optional[torch.Tensor] = None, norm_topk_prob: bool = True,
             routed_scaling_factor: float = 1.0, scoring_func: Optional[str] = None,
             ids_dtype: torch.dtype = torch.int32, n_shared: int = 0,
             pad: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (or hidden [T, H] with gate_weight [E, H]; logits in float32)
    -> (topk_weights [T, top_k + n_shared] float32, topk_ids [T, top_k + n_shared] ids_dtype).
    With gate_weight and FUSED_MIN_T to FUSED_MAX_T rows, the logits and the gate run in one launch
    (`_router_gate_kernel`); otherwise the logits are a float32 matmul first. pad: bool [P <= T], True at
    padding rows (a padded forward's, engine/model/context.py): their ids are -1, no expert (read in the same
    launch; rows past P are routed)."""
    if method not in METHODS:
        raise ValueError(f"unknown gate method {method!r}; expected one of {sorted(METHODS)}")
    t = x.shape[0]
    e = gate_weight.shape[0] if gate_weight is not None else x.shape[1]
    if method == "greedy":
        n_group = topk_group = 1
    if e % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (e // n_group):
        raise ValueError(f"E={e}, n_group={n_group}, topk_group={topk_group}, top_k={top_k} do not fit")
    weights = torch.empty((t, top_k + n_shared), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k + n_shared), dtype=ids_dtype, device=x.device)
    if t == 0 or top_k + n_shared == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    gate = dict(TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_SIZE=e // n_group,
                METHOD=METHODS[method], SIGMOID=_scoring(method, scoring_func) == "sigmoid",
                HAS_BIAS=correction_bias is not None and method == "noaux_tc", NORM=norm_topk_prob and top_k > 1,
                N_SHARED=n_shared, HAS_PAD=pad is not None, BLOCK_E=block_e, BLOCK_G=triton.next_power_of_2(n_group),
                BLOCK_K=triton.next_power_of_2(top_k + n_shared))
    pad_rows = pad.view(torch.int8) if pad is not None else ids  # (ids: an unread stand-in without pad)
    pads = (pad_rows, pad.shape[0] if pad is not None else 0)
    if gate_weight is not None and FUSED_MIN_T <= t <= FUSED_MAX_T:
        router_gate(x, gate_weight, correction_bias, weights, ids, float(routed_scaling_factor), gate, pads)
        return weights, ids
    logits = _logits(x, gate_weight)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_t = max(1, min(16, 2048 // block_e, triton.next_power_of_2(t)))
    bias = correction_bias if correction_bias is not None else logits
    _moe_gate_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, weights, ids, *pads, t, e, logits.stride(0), float(routed_scaling_factor), BLOCK_T=block_t,
        num_warps=ONE_ROW_GATE_WARPS if t == 1 else GATE_WARPS, **gate, **launch_options())
    return weights, ids


# Measured on an H200 at V2's and V3's router shapes (docs/perf.md, "The router at decode sizes"): the fused router
# wins from 2 to 4 rows (0.56-0.80x the three launches); one row is fastest as the three launches with a one-warp
# gate (its reductions stay inside a warp), larger batches as the three launches with four warps.
FUSED_MIN_T, FUSED_MAX_T = 2, 4  # rows for which `moe_gate` computes the router logits inside the gate's launch
ROUTER_BLOCK_EW = 16  # experts per program of the fused router
ROUTER_TILE_PER_WARP = 2048  # rows x experts x hidden elements a program multiplies per step, per warp (registers)
GATE_WARPS = 4  # warps of the gate kernel above one row, and of the fused router
ONE_ROW_GATE_WARPS = 1  # warps of the gate kernel for one row


def router_split(blocks: int, h: int, block_h: int, device: torch.device) -> int:
    """Hidden parts of the fused router: about two programs per SM over the `blocks` expert blocks, each part at
    least four BLOCK_H steps (at most 2 on CPU, where the interpreter runs every program in turn)."""
    most = max(1, triton.cdiv(h, 4 * block_h))
    if device.type != "cuda":
        return min(2, most)
    return max(1, min(triton.cdiv(2 * split_k.sm_count(device), blocks), most, 16))


def router_gate(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor], weights: torch.Tensor,
                ids: torch.Tensor, scaling: float, gate: dict, pads: tuple) -> None:
    """The fused router (`_router_gate_kernel`) into weights / ids (pads: the padding rows' int8 marks and
    their count, see `moe_gate`)."""
    t, h = x.shape
    e = gate_weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_t = max(2, triton.next_power_of_2(t))
    block_ew = min(ROUTER_BLOCK_EW, gate["BLOCK_E"])
    block_h = max(32, min(256, ROUTER_TILE_PER_WARP * GATE_WARPS // (block_t * block_ew)))
    blocks = triton.cdiv(e, block_ew)
    parts = router_split(blocks, h, block_h, x.device)
    programs = blocks * parts
    ws = torch.empty(parts * block_t * gate["BLOCK_E"], dtype=torch.float32, device=x.device)
    _router_gate_kernel[(programs,)](
        x, gate_weight, ws, split_k.arrivals(x.device), bias if bias is not None else gate_weight, weights, ids,
        *pads, t, e, h, x.stride(0), gate_weight.stride(0), scaling, BLOCK_T=block_t, BLOCK_EW=block_ew,
        BLOCK_H=block_h, SPLIT_H=parts, PROGRAMS=programs, num_warps=GATE_WARPS, **gate, **launch_options())
