"""MLA decode attention over the paged latent KV cache (absorbed MLA), in Triton.

One KV head (the latent c_kv plus the shared rope key k_pe) serves every query
head, so one program takes a group of query heads (BLOCK_H rows) against each
KV tile: q.k and p.v run on tensor cores (`tl.dot`), and every cached row is read
once per head group. Long contexts are cut into splits handled by separate
programs (stage 1 writes a normalised partial output and its log-sum-exp per
split); stage 2 merges the splits by log-sum-exp. With one split per request
stage 1 writes the final output directly.

Cache layout: `kv_cache` is [num_slots, 1, Lkv + R] or [num_slots, Lkv + R]
(bf16, fp16, fp32 or float8_e4m3fn with a scale: dequantised = stored * kv_scale);
row s holds c_kv (first Lkv values, also the value vector) then k_pe (R values).
FP8 rows are upcast in-kernel (to fp16 by default: exact for e4m3, queries are
clamped to fp16's range) and kv_scale is applied to the scores and the output.
With `kv_load="fp8dot"` (e4m3 caches; the default at 64+ query rows per request) the
queries are instead quantised to e4m3 once per program (one scale per query row,
separately for the latent and the rope part) and q.k runs as an FP8 tensor-core dot
on the cache bytes as stored; only V is upcast. That adds the queries' e4m3 rounding
(3 mantissa bits) to the scores: see KV_LOADS.
`req_to_token[row, pos]` is the slot of token `pos` of the request in `row`.

Several query tokens per request (speculative verification, `q_per_req=Q`): the
query rows are grouped per request, row i belongs to request i // Q and is draft
token j = i % Q, and sees cache positions < seq_lens[i // Q] - (Q - 1 - j)
(the draft tokens' own KV is already in the cache, causal among the drafts).
A query row that sees no position outputs zeros.

`mla_decode_ref` is the pure-torch reference (gathers rows, softmax in float32 or
float64).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter
from kernels.tuned_configs import MLA_KV_NAMES, get_mla_decode_config

_LOG2E = 1.4426950408889634


# How stage 1 reads the KV tiles (DecodeConfig.kv_load):
#   "tile":   one [BLOCK_N, Lkv+R] tile feeds both dots (K^T through tl.trans); the
#             slot indices are loaded one tile ahead so that Triton multi-buffers the
#             tile with cp.async. For 16-bit caches.
#   "split":  K^T and V loaded separately (the second read of a row hits L2), each
#             upcast right before its dot: Triton pipelines a load -> convert -> dot
#             chain, not one load feeding two dots through a conversion. FP8 caches.
#   "fp8dot": as "split", but K^T is not upcast: the queries are quantised to e4m3
#             at program start (per query row, scale = amax / 448, separately for the
#             Lkv latent and the R rope values) and q.k is an FP8 x FP8 tensor-core dot
#             (fp32 accumulate) on the K^T tile as loaded; the two per-row scales are
#             applied to the two dots' fp32 results. V is upcast as in "split". The K^T
#             tile is K-major (each cached row is contiguous), the operand order that
#             FP8 wgmma needs. float8_e4m3fn caches only: mla_decode silently runs e5m2
#             caches with "split" and 16/32-bit caches with "tile". The default for e4m3
#             caches at 64+ query rows (128 heads): on H100 1.41x the bf16 cache's speed,
#             1.95x "split" (docs/perf.md). On sm_90 Triton emits FP8 wgmma only for head
#             blocks of a multiple of 64 rows (and K >= 32); a smaller block (block_h 16
#             or 32) runs mma.sync, for which Triton itself upcasts both FP8 operands to
#             fp16 in the kernel, so expect no gain there.
#             Error: the queries' e4m3 rounding. On random test data (CPU interpreter,
#             reference on the same FP8 cache) 1.6-3.0% relative on the output at softmax
#             scale 0.06 (8% at a sharp 0.3), against 0.3-0.5% for "split"; 0.5-0.8x of
#             what the cache's own e4m3 quantisation costs (tests/kernels/test_mla_decode.py).
# (Measured on H100 and dropped, see docs/perf.md: FP8 read as 32-bit words and
# upcast with inline PTX, alone or for V only; both were slower than "split". Measured on
# H200 and dropped, 16 heads (docs/perf.md, issue 40): V, or the whole tile feeding both
# dots, read as 32-bit words and upcast with shifts and bitcasts before Triton lays it out
# for the dots, so that p.V reads a 16-bit tile with ldmatrix.trans instead of one byte per
# shared-memory load (102 shared loads per thread per tile against 222, 176-184 registers
# against 235): 1.12-1.21x "split"'s time for V alone, 1.23-1.52x for the whole tile. Also dropped:
# one 8-bit tile per stage feeding both dots, upcast once by inline-PTX cvt (e4m3x2 -> f16x2) before
# Triton lays it out (1,088 loop instructions per tile against "split"'s 1,309, 92 KB of shared
# memory against 160 KB): 1.00-1.14x "split"'s time at batch 8-128, context 4k-16k.)
# At 128 heads (64-row head groups, 8 warps) Triton 3.6 treats q.k as a dot chained into p.V and
# gives it all 8 warps along its 64 rows, so both warpgroups compute the same q.k (74 wgmma
# instructions per tile instead of 38); the 64 x 512 fp32 accumulator holds 255 registers. Measured
# on H200 and dropped (docs/perf.md, issue 40): token-major scores (S^T = K q^T, O^T = V^T P^T;
# 1.1-3x slower, spills), p through a global scratch tile to unchain the dots (the barriers it needs
# stop the cp.async pipelining: 1.2x slower), rescaling the accumulator only when a row max grows.
KV_LOADS = {"tile": 0, "split": 1, "fp8dot": 2}


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels."""

    block_h: int = 16  # query rows (heads x draft tokens) per program
    block_n: int = 32  # cached tokens per tile
    num_warps: int = 4
    num_stages: int = 3
    kv_load: str = "tile"  # see KV_LOADS
    fp16_math: bool = False  # FP8 caches: fp16 dots (e4m3 -> fp16 is one cvt per 2 values) instead of bf16
    min_split_tokens: int = 256  # a request is cut into at most cdiv(seq_len, this) splits
    programs_per_sm: float = 1.0  # default splits: floor(this * num_SMs / (requests x head groups))


@triton.jit
def _num_splits(seq_len, max_splits, min_split_tokens):
    n = (seq_len + min_split_tokens - 1) // min_split_tokens
    return tl.minimum(tl.maximum(n, 1), max_splits)


@triton.jit
def _split_len(seq_len, n_splits, BLOCK_N: tl.constexpr):
    per = (seq_len + n_splits - 1) // n_splits
    return ((per + BLOCK_N - 1) // BLOCK_N) * BLOCK_N


@triton.jit
def dot_operand(x, COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Round a dot operand to the tensor-core type. Triton's interpreter multiplies bf16
    tensors as raw integers, so there the rounded values go to the dot as float32."""
    x = x.to(COMPUTE_DTYPE)
    if INTERPRET:
        x = x.to(tl.float32)
    return x


@triton.jit
def fp8_operand(x, INTERPRET: tl.constexpr):
    """An FP8 dot operand as loaded; in the interpreter its values as float32 (same products,
    fp32 math), since the interpreter's own FP8 dots are not to be relied on."""
    if INTERPRET:
        x = x.to(tl.float32)
    return x


@triton.jit
def _round_e4m3(x, INTERPRET: tl.constexpr):
    """x (float32, |x| <= 448) rounded to float8_e4m3fn, to nearest even. On the GPU the FP8
    tensor (cvt.rn.satfinite); in the interpreter the rounded values as float32, computed
    exactly here: its fp32 -> fp8 cast mis-rounds when the mantissa carries into the exponent."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if INTERPRET:
        expo = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased float32 exponent
        expo = tl.maximum(expo, 127 - 6)  # subnormals (< 2^-6) keep the spacing 2^-9
        ulp = ((expo - 3) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
        r = x / ulp  # exact (power of two), |r| < 16
        r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 adds round to an integer, ties to even
        return r * ulp
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_e4m3(x, INTERPRET: tl.constexpr):
    """Per-row e4m3 quantisation of a query tile: (x / scale rounded to e4m3, scale [rows],
    float32) with scale = max(row amax, tiny) / 448, so x ~= q8 * scale[:, None]."""
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1.0e-30) / 448.0
    return _round_e4m3(x / scale[:, None], INTERPRET), scale


@triton.jit
def _mla_decode_stage1(
    QNope, QRope, KV, KvScalePtr, kv_scale_val, ReqToToken, ReqPool, SeqLens,
    MidO, MidLse, Out,
    qk_scale_log2, max_splits, min_split_tokens,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h,
    stride_kv, stride_rtt,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    stride_o_b, stride_o_h,
    H: tl.constexpr, Q_PER_REQ: tl.constexpr, LKV: tl.constexpr, R: tl.constexpr,
    BLOCK_LKV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALE_PTR: tl.constexpr, KV_LOAD: tl.constexpr, DIRECT_OUT: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
 PDL: tl.constexpr = False):
    pdl_enter(PDL)
    req = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + req).to(tl.int32)
    n_splits = _num_splits(seq_len, max_splits, min_split_tokens)
    if split < n_splits:
        split_len = _split_len(seq_len, n_splits, BLOCK_N)
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        pool_row = tl.load(ReqPool + req).to(tl.int64)

        if SCALE_PTR:
            kv_scale = tl.load(KvScalePtr).to(tl.float32)
        else:
            kv_scale = kv_scale_val
        offs_m = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        m_valid = offs_m < H * Q_PER_REQ
        draft = offs_m // H
        head = offs_m % H
        qrow = (req * Q_PER_REQ + draft).to(tl.int64)
        limit = seq_len - (Q_PER_REQ - 1 - draft)  # positions < limit are visible to this row

        offs_d = tl.arange(0, BLOCK_LKV)
        offs_r = tl.arange(0, BLOCK_R)
        d_mask = offs_d < LKV
        r_mask = offs_r < R
        q = tl.load(QNope + qrow[:, None] * stride_qn_b + head[:, None] * stride_qn_h + offs_d[None, :],
                    mask=m_valid[:, None] & d_mask[None, :], other=0.0)
        qpe = tl.load(QRope + qrow[:, None] * stride_qr_b + head[:, None] * stride_qr_h + offs_r[None, :],
                      mask=m_valid[:, None] & r_mask[None, :], other=0.0)
        score_scale = qk_scale_log2 * kv_scale
        if KV_LOAD == 2:
            # e4m3 queries for the FP8 q.k dots; each row's two scales (latent, rope) are
            # folded with the score scale and applied to the dots' fp32 results.
            q, s_nope = _quantize_rows_e4m3(q, INTERPRET)
            qpe, s_rope = _quantize_rows_e4m3(qpe, INTERPRET)
            s_nope = s_nope * score_scale
            s_rope = s_rope * score_scale
        else:
            if COMPUTE_DTYPE == tl.float16:  # keep out-of-range queries finite (fp16 max 65504)
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
                qpe = tl.minimum(tl.maximum(qpe.to(tl.float32), -65504.0), 65504.0)
            q = dot_operand(q, COMPUTE_DTYPE, INTERPRET)
            qpe = dot_operand(qpe, COMPUTE_DTYPE, INTERPRET)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: fully masked rows give p = 0, not NaN
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_LKV], dtype=tl.float32)

        # The next tile's slot indices are loaded one iteration ahead: with the KV
        # address no longer depending on a load of the same iteration, Triton
        # multi-buffers the KV tiles (cp.async) instead of loading them serially.
        idx_ptr = ReqToToken + pool_row * stride_rtt
        offs_n = start + tl.arange(0, BLOCK_N)
        loc_next = tl.load(idx_ptr + offs_n, mask=offs_n < end, other=0)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            next_n = offs_n + BLOCK_N
            loc = loc_next.to(tl.int64)
            loc_next = tl.load(idx_ptr + next_n, mask=next_n < end, other=0)
            row_ptr = KV + loc[:, None] * stride_kv
            if KV_LOAD == 0:
                kv = tl.load(row_ptr + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
                kpe = tl.load(row_ptr + LKV + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
                kv = dot_operand(kv, COMPUTE_DTYPE, INTERPRET)
                qk = tl.dot(q, tl.trans(kv))
                qk += tl.dot(qpe, tl.trans(dot_operand(kpe, COMPUTE_DTYPE, INTERPRET)))
                qk = qk * score_scale
            else:
                # K^T [LKV | R, BLOCK_N] tiles (K-major: a row's values are contiguous) and V read
                # separately; "split" upcasts K^T for 16-bit dots, "fp8dot" feeds it as stored to
                # FP8 x FP8 dots on the e4m3 queries. V is upcast in both.
                col_ptr = KV + loc[None, :] * stride_kv
                kt = tl.load(col_ptr + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
                kpet = tl.load(col_ptr + LKV + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None], other=0.0)
                if KV_LOAD == 1:
                    qk = tl.dot(q, dot_operand(kt, COMPUTE_DTYPE, INTERPRET))
                    qk += tl.dot(qpe, dot_operand(kpet, COMPUTE_DTYPE, INTERPRET))
                    qk = qk * score_scale
                else:
                    qk = tl.dot(q, fp8_operand(kt, INTERPRET)) * s_nope[:, None]
                    qk += tl.dot(qpe, fp8_operand(kpet, INTERPRET)) * s_rope[:, None]
                kv = tl.load(row_ptr + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
                kv = dot_operand(kv, COMPUTE_DTYPE, INTERPRET)
            visible = n_mask[None, :] & (offs_n[None, :] < limit[:, None])
            qk = tl.where(visible, qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(dot_operand(p, COMPUTE_DTYPE, INTERPRET), kv)
            m_i = m_new

        has = l_i > 0.0
        o = acc * (kv_scale / tl.where(has, l_i, 1.0))[:, None]
        if DIRECT_OUT:
            o_ptr = Out + qrow[:, None] * stride_o_b + head[:, None] * stride_o_h + offs_d[None, :]
            tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            mo_ptr = MidO + qrow[:, None] * stride_mo_b + head[:, None] * stride_mo_h + split * stride_mo_s
            tl.store(mo_ptr + offs_d[None, :], o, mask=m_valid[:, None] & d_mask[None, :])
            tl.store(MidLse + qrow * stride_ml_b + head * stride_ml_h + split, lse, mask=m_valid)


@triton.jit
def _mla_decode_stage2(
    MidO, MidLse, Out, SeqLens, max_splits, min_split_tokens,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    stride_o_b, stride_o_h,
    Q_PER_REQ: tl.constexpr, LKV: tl.constexpr, BLOCK_LKV: tl.constexpr, BLOCK_N: tl.constexpr,
 PDL: tl.constexpr = False):
    pdl_enter(PDL)
    qrow = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    req = qrow // Q_PER_REQ
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    n_splits = _num_splits(seq_len, max_splits, min_split_tokens)
    split_len = _split_len(seq_len, n_splits, BLOCK_N)
    n_used = (seq_len + split_len - 1) // tl.maximum(split_len, 1)  # splits that hold any token
    n_used = tl.maximum(tl.minimum(n_used, n_splits), 1)

    offs_d = tl.arange(0, BLOCK_LKV)
    d_mask = offs_d < LKV
    m_i = -1.0e30  # finite: exp2 of an empty (-inf) split stays 0, never NaN
    s_i = 0.0
    acc = tl.zeros([BLOCK_LKV], dtype=tl.float32)
    mo_ptr = MidO + qrow * stride_mo_b + head * stride_mo_h
    for s in range(0, n_used):
        lse = tl.load(MidLse + qrow * stride_ml_b + head * stride_ml_h + s)
        o = tl.load(mo_ptr + s * stride_mo_s + offs_d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m_i, lse)
        old = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * old + w * o
        s_i = s_i * old + w
        m_i = m_new
    out = acc / tl.where(s_i > 0.0, s_i, 1.0)
    tl.store(Out + qrow * stride_o_b + head * stride_o_h + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def _compute_dtype(kv_dtype: torch.dtype, fp16_math: bool):
    """Operand type of the tensor-core dots: the cache's; for FP8 caches fp16 or bf16."""
    if kv_dtype.itemsize == 1 and fp16_math:
        return tl.float16
    return {torch.float16: tl.float16, torch.float32: tl.float32}.get(kv_dtype, tl.bfloat16)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(num_q_rows_per_req: int, kv_dtype: torch.dtype) -> DecodeConfig:
    """Launch parameters: the fastest of benchmarks/bench_mla.py --sweep on H100 (docs/perf.md).

    num_q_rows_per_req = heads x query tokens per request. Every config is correct on
    any shape; these only set speed.
    """
    rows = num_q_rows_per_req
    fp8 = kv_dtype.itemsize == 1
    if kv_dtype.itemsize >= 4:  # fp32 caches: the 16-bit tiles would need 290-330 KB of shared memory (227 KB)
        return DecodeConfig(block_h=16 if rows <= 16 else 32, block_n=32 if rows <= 16 else 16, num_warps=4,
                            num_stages=2, min_split_tokens=256 if rows <= 32 else 128)
    if rows <= 32:  # 16 heads (TP 8), also with 2 draft tokens: one program per request's rows
        return DecodeConfig(block_h=16 if rows <= 16 else 32, block_n=64, num_warps=8, num_stages=3,
                            kv_load="split" if fp8 else "tile", fp16_math=fp8, min_split_tokens=256)
    # 128 heads (DP attention): 64-row head groups (wgmma), compute-bound. An e4m3 cache runs q.k as FP8
    # dots ("fp8dot": 1.41x the bf16 cache's speed and 1.95x "split" at batch 32 / 4k on H100, docs/perf.md);
    # e5m2 has no e4m3 dot partner and keeps "split" with bf16 dots.
    if kv_dtype == torch.float8_e4m3fn:
        return DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, kv_load="fp8dot", fp16_math=True,
                            min_split_tokens=128)
    return DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, kv_load="split" if fp8 else "tile",
                        min_split_tokens=128)


def config_to_ints(cfg: DecodeConfig) -> dict:
    """A DecodeConfig as the tuned table's integer keys (kernels/tuned_configs.py MLA_DECODE_KEYS)."""
    if cfg.programs_per_sm != int(cfg.programs_per_sm):
        raise ValueError(f"programs_per_sm must be whole to be stored, got {cfg.programs_per_sm}")
    return dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                KV_LOAD=KV_LOADS[cfg.kv_load], FP16_MATH=int(cfg.fp16_math), MIN_SPLIT_TOKENS=cfg.min_split_tokens,
                PROGRAMS_PER_SM=int(cfg.programs_per_sm))


def config_from_ints(entry: dict) -> DecodeConfig:
    """The DecodeConfig of a tuned table's entry (its other keys, such as FLASHINFER, ignored)."""
    loads = {v: k for k, v in KV_LOADS.items()}
    return DecodeConfig(block_h=entry["BLOCK_H"], block_n=entry["BLOCK_N"], num_warps=entry["num_warps"],
                        num_stages=entry["num_stages"], kv_load=loads[entry["KV_LOAD"]],
                        fp16_math=bool(entry["FP16_MATH"]), min_split_tokens=entry["MIN_SPLIT_TOKENS"],
                        programs_per_sm=float(entry["PROGRAMS_PER_SM"]))


def tuned_entry(num_q_rows_per_req: int, kv_dtype: torch.dtype, batch: int, device: torch.device) -> Optional[dict]:
    """This GPU's MLA decode table entry for `batch` requests (`dsctl tune-mla`; None: no table)."""
    if device.type != "cuda":
        return None
    return get_mla_decode_config(num_q_rows_per_req, MLA_KV_NAMES[kv_dtype], batch, device=device)


def tuned_config(num_q_rows_per_req: int, kv_dtype: torch.dtype, batch: int, device: torch.device) -> DecodeConfig:
    """The launch parameters for `batch` requests: this GPU's tuned table where there is one, else
    `default_config`."""
    entry = tuned_entry(num_q_rows_per_req, kv_dtype, batch, device)
    return config_from_ints(entry) if entry is not None else default_config(num_q_rows_per_req, kv_dtype)


def _default_splits(num_reqs: int, head_groups: int, max_ctx: int, cfg: DecodeConfig, device: torch.device) -> int:
    """Splits per request so that the stage-1 grid fills whole waves: floor, not ceil, since
    a few programs spilling into a second wave would double the time."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    want = math.floor(cfg.programs_per_sm * sms / max(1, num_reqs * head_groups))
    cap = max(1, math.ceil(max_ctx / cfg.min_split_tokens))
    return int(max(1, min(want, cap, 64)))


@functools.lru_cache(maxsize=None)
def _fp8_dots(device_index: int) -> bool:
    """Whether this GPU multiplies e4m3 operands natively (compute capability 8.9+; Triton rejects
    float8e4nv on older GPUs)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _kv_load(requested: str, kv_dtype: torch.dtype, device: torch.device) -> str:
    """The KV load mode that runs: 8-bit caches "split", or "fp8dot" where requested, the cache is
    float8_e4m3fn (e5m2 has no e4m3 dot partner here: "split") and the GPU has FP8 dots (or this is
    the CPU interpreter); 16/32-bit caches the requested mode, "fp8dot" there meaning "tile"."""
    if requested not in KV_LOADS:
        raise ValueError(f"kv_load must be one of {sorted(KV_LOADS)}, got {requested!r}")
    if kv_dtype.itemsize == 1:  # 8-bit tiles need one dot per load
        fp8_dots = device.type != "cuda" or _fp8_dots(device.index if device.index is not None
                                                      else torch.cuda.current_device())
        return "fp8dot" if requested == "fp8dot" and kv_dtype == torch.float8_e4m3fn and fp8_dots else "split"
    return "tile" if requested == "fp8dot" else requested


def mla_decode(q_nope_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               sm_scale: float, num_kv_splits: int | None = None, q_per_req: int = 1,
               kv_scale: float | torch.Tensor = 1.0, out: torch.Tensor | None = None,
               config: DecodeConfig | None = None) -> torch.Tensor:
    """Absorbed-MLA decode attention; returns the latent-space output [B*Q, H, Lkv].

    q_nope_latent [B*Q, H, Lkv], q_rope [B*Q, H, R]; kv_cache [num_slots, (1,) Lkv+R];
    req_to_token [max_reqs, max_ctx] int32; req_pool_indices, seq_lens [B] (one per
    request, seq_lens counting every cached token including the Q draft tokens).
    num_kv_splits caps the splits per request (None: chosen from batch size and SM
    count; with it given, splits are as small as one tile). kv_scale: python float
    or a 1-element tensor on the device (read in-kernel, no host sync). out: optional
    preallocated [B*Q, H, Lkv] output (written in full); config: the launch parameters (default: this GPU's
    tuned table, `tuned_config`, else `default_config`). config.kv_load="fp8dot" (opt-in):
    on a float8_e4m3fn cache, q.k as FP8 dots on per-row e4m3-quantised queries; a
    float8_e5m2 cache silently runs "split" instead, a 16/32-bit cache "tile" (KV_LOADS).
    """
    rows, num_heads, lkv = q_nope_latent.shape
    rope = q_rope.shape[-1]
    num_reqs = seq_lens.shape[0]
    if rows != num_reqs * q_per_req or q_rope.shape[:2] != (rows, num_heads):
        raise ValueError(f"query rows {rows} != {num_reqs} requests x q_per_req {q_per_req}")
    kv = kv_cache.squeeze(1) if kv_cache.dim() == 3 and kv_cache.shape[1] == 1 else kv_cache
    if kv.dim() != 2 or kv.shape[-1] != lkv + rope or kv.stride(-1) != 1:
        raise ValueError(f"kv_cache rows must be contiguous with {lkv}+{rope} values, got {tuple(kv_cache.shape)}")
    if q_nope_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("q_nope_latent, q_rope and req_to_token need a contiguous last dimension")
    if out is None:
        out = q_nope_latent.new_empty(rows, num_heads, lkv)
    if rows == 0:
        return out

    cfg = config or tuned_config(num_heads * q_per_req, kv.dtype, num_reqs, kv.device)
    head_groups = triton.cdiv(num_heads * q_per_req, cfg.block_h)
    if num_kv_splits is None:
        max_splits = _default_splits(num_reqs, head_groups, req_to_token.shape[1], cfg, q_nope_latent.device)
        min_split = cfg.min_split_tokens
    else:
        max_splits, min_split = max(1, int(num_kv_splits)), cfg.block_n
    direct = max_splits == 1
    if direct:
        mid_o = out
        mid_lse = out  # unused
        mo_strides = (0, 0, 0)
        ml_strides = (0, 0)
    else:
        mid_o = torch.empty(rows, num_heads, max_splits, lkv, dtype=torch.float32, device=out.device)
        mid_lse = torch.empty(rows, num_heads, max_splits, dtype=torch.float32, device=out.device)
        mo_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
        ml_strides = (mid_lse.stride(0), mid_lse.stride(1))

    kv_load = _kv_load(cfg.kv_load, kv.dtype, kv.device)
    scale_ptr = isinstance(kv_scale, torch.Tensor)
    block_lkv = triton.next_power_of_2(lkv)
    block_r = max(16, triton.next_power_of_2(rope))
    if kv_load == "fp8dot":  # Triton's smallest K of a dot on 8-bit operands is 32
        block_lkv, block_r = max(32, block_lkv), max(32, block_r)
    _mla_decode_stage1[(num_reqs, head_groups, max_splits)](
        q_nope_latent, q_rope, kv, kv_scale if scale_ptr else kv, 1.0 if scale_ptr else float(kv_scale),
        req_to_token, req_pool_indices, seq_lens,
        mid_o, mid_lse, out,
        float(sm_scale) * _LOG2E, max_splits, min_split,
        q_nope_latent.stride(0), q_nope_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv.stride(0), req_to_token.stride(0),
        *mo_strides, *ml_strides,
        out.stride(0), out.stride(1),
        H=num_heads, Q_PER_REQ=q_per_req, LKV=lkv, R=rope,
        BLOCK_LKV=block_lkv, BLOCK_R=block_r, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        SCALE_PTR=scale_ptr, KV_LOAD=KV_LOADS[kv_load], DIRECT_OUT=direct,
        COMPUTE_DTYPE=_compute_dtype(kv.dtype, cfg.fp16_math), INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
     **launch_options())
    if not direct:
        _mla_decode_stage2[(rows, num_heads)](
            mid_o, mid_lse, out, seq_lens, max_splits, min_split,
            *mo_strides, *ml_strides,
            out.stride(0), out.stride(1),
            Q_PER_REQ=q_per_req, LKV=lkv, BLOCK_LKV=block_lkv, BLOCK_N=cfg.block_n,
            num_warps=4 if block_lkv >= 256 else 1,
         **launch_options())
    return out


def mla_decode_ref(q_nope_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                   sm_scale: float, q_per_req: int = 1, kv_scale: float | torch.Tensor = 1.0,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch reference of `mla_decode` (same arguments); output in q's dtype."""
    rows, num_heads, lkv = q_nope_latent.shape
    kv = kv_cache.reshape(kv_cache.shape[0], -1)
    scale = float(kv_scale)
    out = torch.zeros(rows, num_heads, lkv, dtype=compute_dtype, device=q_nope_latent.device)
    for r in range(seq_lens.shape[0]):
        n = int(seq_lens[r])
        slots = req_to_token[int(req_pool_indices[r]), :n].long()
        cache = kv[slots].to(compute_dtype) * scale
        c, kpe = cache[:, :lkv], cache[:, lkv:]
        for j in range(q_per_req):
            i = r * q_per_req + j
            visible = n - (q_per_req - 1 - j)
            if visible <= 0:
                continue
            q = q_nope_latent[i].to(compute_dtype)
            qp = q_rope[i].to(compute_dtype)
            scores = (q @ c[:visible].T + qp @ kpe[:visible].T) * sm_scale
            out[i] = scores.softmax(-1) @ c[:visible]
    return out.to(q_nope_latent.dtype)
