"""Paged multi-head attention decode over per-head K/V (MLA without weight absorption), in Triton.

With --disable-mla the KV cache keeps, per token, every head's key and value side by
side: row = [head 0: k (Dqk) | v (Dv), head 1: ..., ...] (H x (Dqk + Dv) values). One
query per request attends to the first seq_len slots of its row of the req->token
table. One program takes one (request, head): it streams the request's keys and
values in BLOCK_N tiles with an online softmax in float32 (one query row: the dot
products are sums, no tensor-core tile). Dqk (192 for DeepSeek-V3) is split into a
power-of-two part and the rest, as in kernels/mla_extend.py.

Shapes are fixed by the batch and lengths are read from device tensors, so a decode
step can be captured in a CUDA graph. A bf16/fp16/float32 cache is read as is; an FP8
cache is dequantised with its scale (stored x kv_scale).

`mha_decode_ref` is the pure-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _mha_decode(Q, KV, Table, Rows, Lens, Out, qk_scale, kv_scale,
                stride_qb, stride_qh, stride_kv, stride_table, stride_ob, stride_oh,
                D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr, HAS_D2: tl.constexpr,
                DV: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_STRIDE: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(Lens + b).to(tl.int32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    q1 = tl.load(q_ptr + offs_d1).to(tl.float32)
    q2 = tl.load(q_ptr + D1 + offs_d2, mask=offs_d2 < D2, other=0.0).to(tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    head = KV + h * HEAD_STRIDE
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        valid = pos < seq_len
        slots = tl.load(Table + row * stride_table + pos, mask=valid, other=0).to(tl.int64)
        base = head + slots[:, None] * stride_kv
        k1 = tl.load(base + offs_d1[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k1 * q1[None, :], 1)
        if HAS_D2:
            k2 = tl.load(base + D1 + offs_d2[None, :], mask=valid[:, None] & (offs_d2[None, :] < D2),
                         other=0.0).to(tl.float32)
            s += tl.sum(k2 * q2[None, :], 1)
        s = tl.where(valid, s * (kv_scale * qk_scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s[None, :] - m_new[:, None])  # [1, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(base + D1 + D2 + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < DV),
                    other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(tl.trans(p) * v, 0)
        m_i = m_new
    out = acc * kv_scale / tl.maximum(l_i, 1e-30)  # seq_len 0 (a padded row): zeros, not NaN
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty),
             mask=offs_dv < DV)


def _split_dim(dqk: int) -> tuple[int, int]:
    """Dqk = D1 (largest power of two <= Dqk) + D2 (the rest, may be 0)."""
    d1 = 1 << (dqk.bit_length() - 1)
    return d1, dqk - d1


def mha_decode(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
               seq_lens: torch.Tensor, dv: int, sm_scale: float, kv_scale: float = 1.0,
               out: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of one query per request over its cached per-head K/V.

    q [B, H, Dqk]; kv_cache [slots, H * (Dqk + dv)] (one layer of the pool); req_to_token
    [R, max_ctx] int slot table; rows [B] its row per request; seq_lens [B] keys per request
    (device tensors). Returns [B, H, dv] in q's dtype.
    """
    b, h, dqk = q.shape
    if kv_cache.shape[-1] != h * (dqk + dv):
        raise ValueError(f"kv_cache rows hold {kv_cache.shape[-1]} values, expected heads {h} x ({dqk} + {dv})")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last dimension")
    if out is None:
        out = q.new_empty(b, h, dv)
    if b == 0:
        return out
    d1, d2 = _split_dim(dqk)
    if block_n is None:
        block_n = 64 if q.is_cuda else 16
    _mha_decode[(b, h)](
        q, kv_cache, req_to_token, rows, seq_lens, out, float(sm_scale) * _LOG2E, float(kv_scale),
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0), out.stride(0), out.stride(1),
        D1=d1, D2=d2, BLOCK_D2=max(16, triton.next_power_of_2(max(d2, 1))), HAS_D2=d2 > 0,
        DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), HEAD_STRIDE=dqk + dv, BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def mha_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                   seq_lens: torch.Tensor, dv: int, sm_scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """Pure-torch reference of `mha_decode`: one request at a time, float32 softmax."""
    b, h, dqk = q.shape
    out = torch.zeros(b, h, dv, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        slots = req_to_token[int(rows[i]), :n].long()
        kv = kv_cache[slots].float().view(n, h, dqk + dv) * kv_scale
        scores = torch.einsum("hd,nhd->hn", q[i].float(), kv[..., :dqk]) * sm_scale
        out[i] = torch.einsum("hn,nhv->hv", scores.softmax(-1), kv[..., dqk:])
    return out.to(q.dtype)
