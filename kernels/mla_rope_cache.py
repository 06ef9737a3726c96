"""The MLA layer's step between its projections and attention, in one Triton kernel.

    q_pe, c_kv, k_pe = mla_rope_cache(q, latent, norm_weight, eps, cos, sin, positions, kv_lora_rank, nope,
                                      cache, slots, kv_scale)

does what engine/model/attention.py's torch form does (`mla_rope_cache_ref`, the reference):

- c_kv = RMSNorm(latent[:, :kv_lora_rank]) (kv_a_layernorm);
- k_pe = rope(latent[:, kv_lora_rank:]) and q_pe = rope(q[:, :, nope:]) at each token's position, the
  interleaved pairs of engine/model/rope.py (x[2i], x[2i+1] rotated by one frequency, cos / sin tables of
  [positions, rope / 2] float32 with the YaRN magnitude folded in);
- the KV cache row [c_kv, k_pe] written at each token's slot (engine/memory/pools.py `KVPool.write`: an e4m3
  cache stores (value / kv_scale), saturating at +-448, as torch's cast does; a cache in another dtype than
  the values' and not e4m3 is refused).

Why: in torch that is about thirty launches per layer (each rope: two table gathers, a float cast, strided
slices, four products, a sum and a difference, a stack and a cast back; the norm; a concatenation; the FP8
cast; the indexed copy), most of a batch-1 decode step's launches at depth and tiny in bytes. Here it is one.

Numerics follow the reference: the norm is kernels/rms_norm.py's own code on that kernel's tile and warps
(`normed_tile`, `launch_meta`), so its values are those of the RMSNorm kernel; the rotation is two products
and a sum in float32 rounded once to the input dtype, compiled without fused multiply-adds
(`enable_fp_fusion=False`) so that each product is rounded as torch rounds it.

Grid: (token blocks of ROWS tokens, 1 + head blocks). Programs of column 0 normalise, rotate k_pe and write
the cache rows; the others rotate q_pe for HEADS heads of the block's tokens. Positions and slots are read
from device tensors, so a decode step with this kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.fp8 import round_to_e4m3_grid
from kernels.fp8_math import FP8_DTYPE
from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter
from kernels.rms_norm import SUPPORTED_DTYPES, normed_tile, out_dtype, rms_norm_ref, round_to
from kernels.rms_norm import launch_meta as rms_norm_launch_meta  # the RMSNorm kernel's tile: its sums

HEAD_PAIRS = 2048  # (query rows x heads x pairs) one q program rotates


@triton.jit
def _rotate(X, offs, cos, sin, mask, OUT_DTYPE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """The pairs at X + offs (even) and X + offs + 1 (odd) rotated: (even', odd') rounded to OUT_DTYPE."""
    xe = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(X + offs + 1, mask=mask, other=0.0).to(tl.float32)
    even = round_to(xe * cos - xo * sin, OUT_DTYPE, EXACT_ROUND)
    odd = round_to(xo * cos + xe * sin, OUT_DTYPE, EXACT_ROUND)
    return even, odd


@triton.jit
def _cache_value(v, kv_scale, CACHE_FP8: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """A value (already rounded to its dtype) as the cache stores it: e4m3 of v / kv_scale, or v."""
    if CACHE_FP8:
        v = round_to_e4m3_grid(tl.clamp(v.to(tl.float32) / kv_scale, -448.0, 448.0), EXACT_ROUND)
    return v


@triton.jit
def _latent_rows(L, W, COS, SIN, POS, CACHE, SLOTS, CKV, KPE, n_rows, stride_l, stride_c, stride_ckv, stride_kpe,
                 eps, kv_scale, KV_LORA: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr,
                 ROWS: tl.constexpr, WRITE_CACHE: tl.constexpr, CACHE_FP8: tl.constexpr,
                 EXACT_ROUND: tl.constexpr):
    """ROWS tokens' latent: the norm of c_kv, the rotation of k_pe, their cache rows."""
    pairs = tl.arange(0, PAIRS)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    c, c_mask = normed_tile(L, W, rows, cols, n_rows, KV_LORA, stride_l, eps, CKV.dtype.element_ty, EXACT_ROUND)
    tl.store(CKV + rows64[:, None] * stride_ckv + cols[None, :], c, mask=c_mask)
    pos = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    mask = row_ok[:, None] & (pairs < HALF)[None, :]
    table = pos[:, None] * HALF + pairs[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    offs = rows64[:, None] * stride_l + KV_LORA + 2 * pairs[None, :]
    k_even, k_odd = _rotate(L, offs, cos, sin, mask, KPE.dtype.element_ty, EXACT_ROUND)
    out = rows64[:, None] * stride_kpe + 2 * pairs[None, :]
    tl.store(KPE + out, k_even, mask=mask)
    tl.store(KPE + out + 1, k_odd, mask=mask)
    if WRITE_CACHE:
        slot = tl.load(SLOTS + rows, mask=row_ok, other=0).to(tl.int64)
        dst = CACHE + slot[:, None] * stride_c
        kind = CACHE.dtype.element_ty
        tl.store(dst + cols[None, :], _cache_value(c, kv_scale, CACHE_FP8, EXACT_ROUND).to(kind), mask=c_mask)
        rope = dst + KV_LORA + 2 * pairs[None, :]
        tl.store(rope, _cache_value(k_even, kv_scale, CACHE_FP8, EXACT_ROUND).to(kind), mask=mask)
        tl.store(rope + 1, _cache_value(k_odd, kv_scale, CACHE_FP8, EXACT_ROUND).to(kind), mask=mask)


@triton.jit
def _query_rows(Q, COS, SIN, POS, QPE, head_block, n_rows, n_heads, stride_qt, stride_qh, NOPE: tl.constexpr,
                HALF: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
                EXACT_ROUND: tl.constexpr):
    """q_pe of HEADS heads (block `head_block`) of ROWS tokens, as rows of (token, head)."""
    pairs = tl.arange(0, PAIRS)
    idx = tl.arange(0, ROWS * HEADS)
    rows = tl.program_id(0) * ROWS + idx // HEADS
    heads = head_block * HEADS + idx % HEADS
    ok = (rows < n_rows) & (heads < n_heads)
    rows64 = rows.to(tl.int64)
    pos = tl.load(POS + rows, mask=ok, other=0).to(tl.int64)
    mask = ok[:, None] & (pairs < HALF)[None, :]
    table = pos[:, None] * HALF + pairs[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    offs = (rows64 * stride_qt + heads * stride_qh)[:, None] + NOPE + 2 * pairs[None, :]
    even, odd = _rotate(Q, offs, cos, sin, mask, QPE.dtype.element_ty, EXACT_ROUND)
    out = ((rows64 * n_heads + heads) * (2 * HALF))[:, None] + 2 * pairs[None, :]
    tl.store(QPE + out, even, mask=mask)
    tl.store(QPE + out + 1, odd, mask=mask)


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size
def _mla_rope_cache_kernel(Q, L, W, COS, SIN, POS, CACHE, SLOTS, QPE, CKV, KPE,
                           n_rows, n_heads, stride_qt, stride_qh, stride_l, stride_c, stride_ckv, stride_kpe,
                           eps, kv_scale,
                           KV_LORA: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                           BLOCK: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
                           WRITE_CACHE: tl.constexpr, CACHE_FP8: tl.constexpr, EXACT_ROUND: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)
    if tl.program_id(1) == 0:
        _latent_rows(L, W, COS, SIN, POS, CACHE, SLOTS, CKV, KPE, n_rows, stride_l, stride_c, stride_ckv, stride_kpe,
                     eps, kv_scale, KV_LORA, HALF, BLOCK, PAIRS, ROWS, WRITE_CACHE, CACHE_FP8, EXACT_ROUND)
    else:
        _query_rows(Q, COS, SIN, POS, QPE, tl.program_id(1) - 1, n_rows, n_heads, stride_qt, stride_qh, NOPE, HALF,
                    PAIRS, ROWS, HEADS, EXACT_ROUND)


def supported(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, kv_lora_rank: int,
              cache: Optional[torch.Tensor] = None) -> bool:
    """Whether `mla_rope_cache` takes these inputs (else use the reference); a cache must hold rows of
    kv_lora_rank + rope values in e4m3 or in c_kv's dtype."""
    rope = latent.shape[-1] - kv_lora_rank if latent.dim() == 2 else 0
    ok = (q.dim() == 3 and latent.dim() == 2 and q.dtype in SUPPORTED_DTYPES and latent.dtype in SUPPORTED_DTYPES
          and norm_weight.dtype in SUPPORTED_DTYPES and norm_weight.shape == (kv_lora_rank,)
          and rope > 0 and rope % 2 == 0 and q.shape[-1] > rope and q.stride(-1) == 1 and latent.stride(-1) == 1
          and q.shape[0] == latent.shape[0] and q.device == latent.device == norm_weight.device
          and kv_lora_rank <= 16384)
    return ok and (cache is None or (cache.dim() == 2 and cache.shape[1] == kv_lora_rank + rope
                                     and cache.stride(1) == 1
                                     and cache.dtype in (FP8_DTYPE, out_dtype(latent, norm_weight))))


def mla_rope_cache(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, kv_lora_rank: int,
                   cache: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None,
                   kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, nope + rope] (heads and tokens may be strided, the last dimension contiguous), latent
    [T, kv_lora_rank + rope] (rows may be strided), cos / sin [P, rope / 2] float32, positions [T] ->
    (q_pe [T, H, rope] contiguous in q's dtype, c_kv [T, kv_lora_rank], k_pe [T, rope] in latent's dtype),
    and with `cache` [S, kv_lora_rank + rope] and `slots` [T] each token's cache row written."""
    if not supported(q, latent, norm_weight, kv_lora_rank, cache) or (cache is not None and slots is None):
        raise ValueError(f"mla_rope_cache: unsupported q {tuple(q.shape)} {q.dtype} / latent {tuple(latent.shape)} "
                         f"{latent.dtype} / norm weight {tuple(norm_weight.shape)} / cache "
                         f"{None if cache is None else (tuple(cache.shape), cache.dtype)} (with slots: "
                         f"{slots is not None})")
    t, heads, qk = q.shape
    rope = latent.shape[1] - kv_lora_rank
    q_pe = torch.empty(t, heads, rope, dtype=q.dtype, device=q.device)
    c_kv = torch.empty(t, kv_lora_rank, dtype=out_dtype(latent, norm_weight), device=latent.device)
    k_pe = torch.empty(t, rope, dtype=latent.dtype, device=latent.device)
    if t == 0:
        return q_pe, c_kv, k_pe
    write = cache is not None
    block, rows, num_warps = rms_norm_launch_meta(kv_lora_rank)
    pairs = triton.next_power_of_2(rope // 2)
    head_block = min(triton.next_power_of_2(heads), max(1, HEAD_PAIRS // (rows * pairs)))
    w = norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()
    grid = (triton.cdiv(t, rows), 1 + triton.cdiv(heads, head_block))
    _mla_rope_cache_kernel[grid](
        q, latent, w, cos, sin, positions, cache if write else c_kv, slots if write else positions,
        q_pe, c_kv, k_pe, t, heads, q.stride(0), q.stride(1), latent.stride(0), cache.stride(0) if write else 0,
        c_kv.stride(0), k_pe.stride(0), float(eps), float(kv_scale),
        KV_LORA=kv_lora_rank, NOPE=qk - rope, HALF=rope // 2, BLOCK=block, PAIRS=pairs, ROWS=rows,
        HEADS=head_block, WRITE_CACHE=write, CACHE_FP8=write and cache.dtype.itemsize == 1,
        EXACT_ROUND=interpreting(), num_warps=num_warps, enable_fp_fusion=False, **launch_options())
    return q_pe, c_kv, k_pe


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """engine/model/rope.py's rotation of x [T, ..., rope] (interleaved pairs) at positions [T]."""
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos[positions].view(shape), sin[positions].view(shape)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


def mla_rope_cache_ref(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, kv_lora_rank: int,
                       cache: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None,
                       kv_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of `mla_rope_cache`, step by step in torch (the engine's torch form)."""
    rope = latent.shape[1] - kv_lora_rank
    c_kv = rms_norm_ref(latent[:, :kv_lora_rank], norm_weight, eps)
    k_pe = rope_ref(latent[:, kv_lora_rank:], cos, sin, positions)
    q_pe = rope_ref(q[..., q.shape[-1] - rope:], cos, sin, positions)
    if cache is not None:
        row = torch.cat((c_kv, k_pe), dim=-1)
        if row.dtype != cache.dtype:
            row = (row.float() / kv_scale).to(cache.dtype)
        cache.view(torch.uint8 if cache.dtype.itemsize == 1 else cache.dtype).index_copy_(
            0, slots, row.view(torch.uint8) if cache.dtype.itemsize == 1 else row)
    return q_pe, c_kv, k_pe
