"""Extend (prefill) attention with a cached prefix, for MLA's non-absorbed path, in Triton.

Requests are packed: request b's new tokens are rows [cu_ext[b], cu_ext[b+1]) of
q / k / v and its prefix rows [cu_pre[b], cu_pre[b+1]) of k_prefix / v_prefix
(cu_* are the running sums of extend_lens / prefix_lens). New token i of a
request attends to its whole prefix and to new tokens 0..i (causal). Per head,
q and k have Dqk = qk_nope + qk_rope values (192 for DeepSeek-V3, not a power of
two: the dot is split into a power-of-two part and the rest) and v has Dv (128).

One program takes BLOCK_M new tokens of one head of one request, streams the
prefix and then the causal part of the new tokens in BLOCK_N tiles with an
online (flash) softmax in float32.

The prefix and the new tokens before the query block's diagonal are fully visible
(`_attend_visible`, one loop for both); only the diagonal tiles apply the causal mask.

`extend_attention_ref` is the pure-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.interpret import interpreting
from kernels.mla_decode import dot_operand
from kernels.pdl import launch_options, pdl_enter

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of the extend kernel."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    mask_diag_only: bool = True  # causal mask only on the diagonal tiles (a separate loop before them)


def default_config(dqk: int, dv: int, device: torch.device, itemsize: int = 2) -> ExtendConfig:
    """Launch parameters tuned on H100 (see docs/perf.md); any of them is correct everywhere. 4-byte (fp32)
    operands take smaller tiles: the 16-bit tiles need 336 KB of shared memory at DeepSeek's 192 / 128 head
    dims (an H100 / H200 has 227 KB), these 128 KB (tests/kernels/test_shared_memory.py)."""
    if device.type != "cuda":
        return ExtendConfig(block_m=16, block_n=16)
    if itemsize >= 4:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


@triton.jit
def _attend_tile(acc, m_i, l_i, q1, q2, K, V, rows, col_valid, visible, stride_k, stride_v,
                 offs_d1, offs_d2, offs_dv, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                 HAS_D2: tl.constexpr, qk_scale, COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """One BLOCK_N tile of keys/values (row offsets `rows`) folded into the running softmax."""
    rows = rows.to(tl.int64)
    k1 = tl.load(K + rows[:, None] * stride_k + offs_d1[None, :], mask=col_valid[:, None], other=0.0)
    qk = tl.dot(q1, tl.trans(dot_operand(k1, COMPUTE_DTYPE, INTERPRET)))
    if HAS_D2:
        k2 = tl.load(K + rows[:, None] * stride_k + D1 + offs_d2[None, :],
                     mask=col_valid[:, None] & (offs_d2[None, :] < D2), other=0.0)
        qk += tl.dot(q2, tl.trans(dot_operand(k2, COMPUTE_DTYPE, INTERPRET)))
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + rows[:, None] * stride_v + offs_dv[None, :],
                mask=col_valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(dot_operand(p, COMPUTE_DTYPE, INTERPRET), dot_operand(v, COMPUTE_DTYPE, INTERPRET))
    return acc, m_new, l_i


@triton.jit
def _attend_visible(acc, m_i, l_i, q1, q2, K, V, end, valid_len, stride_k, stride_v, offs_n,
                    offs_d1, offs_d2, offs_dv, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                    HAS_D2: tl.constexpr, qk_scale, BLOCK_N: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Key/value rows [0, end) that every query row sees, in BLOCK_N tiles (rows >= valid_len: padding)."""
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + offs_n
        col_valid = cols < valid_len
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, K, V, cols, col_valid, col_valid[None, :],
                                     stride_k, stride_v, offs_d1, offs_d2, offs_dv, D1, D2, DV,
                                     HAS_D2, qk_scale, COMPUTE_DTYPE, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def _extend_fwd(
    Q, K, V, KP, VP, Out, CuExt, CuPre, qk_scale,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kp_t, stride_kp_h, stride_vp_t, stride_vp_h, stride_o_t, stride_o_h,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr, HAS_D2: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, MASK_DIAG_ONLY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    mblk = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (most causal work) blocks first
    head = tl.program_id(1)
    req = tl.program_id(2)
    ext_start = tl.load(CuExt + req).to(tl.int64)
    ext_len = (tl.load(CuExt + req + 1) - ext_start).to(tl.int32)
    if mblk * BLOCK_M < ext_len:
        pre_start = tl.load(CuPre + req).to(tl.int64)
        pre_len = (tl.load(CuPre + req + 1) - pre_start).to(tl.int32)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < ext_len
        offs_d1 = tl.arange(0, D1)
        offs_d2 = tl.arange(0, BLOCK_D2)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_n = tl.arange(0, BLOCK_N)

        q_ptr = Q + (ext_start + offs_m)[:, None] * stride_q_t + head * stride_q_h
        q1 = dot_operand(tl.load(q_ptr + offs_d1[None, :], mask=m_mask[:, None], other=0.0), COMPUTE_DTYPE, INTERPRET)
        q2 = q1
        if HAS_D2:
            q2 = tl.load(q_ptr + D1 + offs_d2[None, :], mask=m_mask[:, None] & (offs_d2[None, :] < D2), other=0.0)
            q2 = dot_operand(q2, COMPUTE_DTYPE, INTERPRET)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # The whole prefix is visible to every new token.
        kp = KP + pre_start * stride_kp_t + head * stride_kp_h
        vp = VP + pre_start * stride_vp_t + head * stride_vp_h
        acc, m_i, l_i = _attend_visible(acc, m_i, l_i, q1, q2, kp, vp, pre_len, pre_len, stride_kp_t, stride_vp_t,
                                        offs_n, offs_d1, offs_d2, offs_dv, D1, D2, DV, HAS_D2, qk_scale, BLOCK_N,
                                        COMPUTE_DTYPE, INTERPRET)

        k = K + ext_start * stride_k_t + head * stride_k_h
        v = V + ext_start * stride_v_t + head * stride_v_h
        # New tokens before this query block: fully visible (no causal mask needed).
        diag_start = (mblk * BLOCK_M // BLOCK_N) * BLOCK_N if MASK_DIAG_ONLY else 0
        acc, m_i, l_i = _attend_visible(acc, m_i, l_i, q1, q2, k, v, diag_start, ext_len, stride_k_t, stride_v_t,
                                        offs_n, offs_d1, offs_d2, offs_dv, D1, D2, DV, HAS_D2, qk_scale, BLOCK_N,
                                        COMPUTE_DTYPE, INTERPRET)
        # The diagonal (everything when MASK_DIAG_ONLY is off): causal mask.
        causal_end = tl.minimum((mblk + 1) * BLOCK_M, ext_len)
        for start_n in range(diag_start, causal_end, BLOCK_N):
            cols = start_n + offs_n
            col_valid = cols < ext_len
            visible = col_valid[None, :] & (cols[None, :] <= offs_m[:, None])
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q1, q2, k, v, cols, col_valid, visible,
                                         stride_k_t, stride_v_t, offs_d1, offs_d2, offs_dv, D1, D2, DV,
                                         HAS_D2, qk_scale, COMPUTE_DTYPE, INTERPRET)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptr = Out + (ext_start + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_dv[None, :]
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))


def _split_dim(dqk: int) -> tuple[int, int]:
    """Dqk = D1 (largest power of two <= Dqk) + D2 (the rest, may be 0)."""
    d1 = 1 << (dqk.bit_length() - 1)
    return d1, dqk - d1


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                     v_prefix: torch.Tensor, extend_lens: torch.Tensor, prefix_lens: torch.Tensor,
                     sm_scale: float, max_extend_len: int | None = None, out: torch.Tensor | None = None,
                     config: ExtendConfig | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over themselves and their cached prefix.

    q, k [T, H, Dqk], v [T, H, Dv] (T = sum of extend_lens); k_prefix [P, H, Dqk],
    v_prefix [P, H, Dv] (P = sum of prefix_lens); extend_lens, prefix_lens [B] int
    tensors on the device. max_extend_len: the largest extend length if the caller
    knows it (saves a device->host sync). Returns [T, H, Dv] in q's dtype.
    """
    t, num_heads, dqk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (t, num_heads) or k_prefix.shape[1:] != (num_heads, dqk) \
            or v_prefix.shape[1:] != (num_heads, dv):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"k_prefix {tuple(k_prefix.shape)} v_prefix {tuple(v_prefix.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("k_prefix", k_prefix), ("v_prefix", v_prefix)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if out is None:
        out = q.new_empty(t, num_heads, dv)
    num_reqs = extend_lens.shape[0]
    if t == 0 or num_reqs == 0:
        return out
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_ext = torch.cat((zero, torch.cumsum(extend_lens, 0).to(torch.int32)))
    cu_pre = torch.cat((zero, torch.cumsum(prefix_lens, 0).to(torch.int32)))
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    cfg = config or default_config(dqk, dv, q.device, q.element_size())
    d1, d2 = _split_dim(dqk)
    if k_prefix.shape[0] == 0:  # keep valid pointers for an empty prefix
        k_prefix, v_prefix = k, v
    compute = {torch.float16: tl.float16, torch.float32: tl.float32}.get(q.dtype, tl.bfloat16)
    grid = (triton.cdiv(max_extend_len, cfg.block_m), num_heads, num_reqs)
    _extend_fwd[grid](
        q, k, v, k_prefix, v_prefix, out, cu_ext, cu_pre, float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_prefix.stride(0), k_prefix.stride(1), v_prefix.stride(0), v_prefix.stride(1),
        out.stride(0), out.stride(1),
        D1=d1, D2=d2, BLOCK_D2=max(16, triton.next_power_of_2(max(d2, 1))), HAS_D2=d2 > 0,
        DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        COMPUTE_DTYPE=compute, INTERPRET=interpreting(), MASK_DIAG_ONLY=cfg.mask_diag_only,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(),
    )
    return out


def extend_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                         v_prefix: torch.Tensor, extend_lens: torch.Tensor, prefix_lens: torch.Tensor,
                         sm_scale: float, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch reference of `extend_attention`; one request at a time, softmax in compute_dtype."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype, device=q.device)
    e0 = p0 = 0
    for n, p in zip(extend_lens.tolist(), prefix_lens.tolist()):
        keys = torch.cat((k_prefix[p0:p0 + p], k[e0:e0 + n])).to(compute_dtype)
        vals = torch.cat((v_prefix[p0:p0 + p], v[e0:e0 + n])).to(compute_dtype)
        qs = q[e0:e0 + n].to(compute_dtype)
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * sm_scale
        q_pos = torch.arange(p, p + n, device=q.device)
        k_pos = torch.arange(p + n, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[e0:e0 + n] = torch.einsum("hqk,khv->qhv", scores.softmax(-1), vals)
        e0, p0 = e0 + n, p0 + p
    return out.to(q.dtype)
