"""RMSNorm in one Triton kernel: out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype).

Why: the torch form (engine/model/layers.py `rms_norm`, here as `rms_norm_ref`) is about
seven elementwise / reduction kernels per call, and a decoder layer calls it three or four
times; in a small-batch decode step those launches cost more than the bytes they move.
One program normalises one row (or a few short rows), the whole row in one masked tile.

Numerics follow the reference step by step: the row in float32, sum of squares / hidden,
rsqrt, the normalised row rounded to x.dtype, then the product with the weight in float32
rounded once to torch's promoted dtype (bf16 * bf16 -> bf16, exactly as torch computes it).
Only the sum of squares is reduced in another order than torch's, so a few elements may
land one rounding step (one ulp of x.dtype) away from the reference.

Rows are the last dimension of x, which must be contiguous; rows may be strided (a column
slice such as latent[:, :kv_lora_rank] is read in place, not copied).

`add_rms_norm_triton` also does the residual add before a decoder layer's norm (x + residual, rounded
as torch's add rounds it, stored as the new residual stream, then normalised) in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 16384  # one tile holds the whole row


@triton.jit
def round_to(v, dtype: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """float32 v rounded to `dtype`, returned as `dtype`. The interpreter's float32 -> bf16
    cast truncates, so under it round to nearest even first (the GPU cast already does)."""
    if EXACT_ROUND:
        if dtype == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def normed_tile(X, W, rows, cols, n_rows, hidden, stride_x, eps, OUT_DTYPE: tl.constexpr,
                EXACT_ROUND: tl.constexpr, R=None, S=None, stride_r=0, stride_s=0, HAS_RESIDUAL: tl.constexpr = False):
    """One [ROWS, BLOCK] tile of rms_norm(x) * w, rounded to OUT_DTYPE (the values the norm stores), and its
    mask. kernels/rms_norm_quant.py calls it too, so that both kernels add the squares in the same order.
    HAS_RESIDUAL: the tile normalised is x + r (rows of R), rounded to X's dtype as torch's add rounds it,
    and stored to S (the residual stream after the add)."""
    row_ok = rows < n_rows
    col_ok = cols < hidden
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = round_to(x + r, X.dtype.element_ty, EXACT_ROUND)
        tl.store(S + rows64 * stride_s + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)  # [ROWS]
    y = round_to(x * inv[:, None], X.dtype.element_ty, EXACT_ROUND).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    return round_to(y * w[None, :], OUT_DTYPE, EXACT_ROUND), mask


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size
def _rms_norm_kernel(X, R, S, W, Out, n_rows, hidden, stride_x, stride_r, stride_s, stride_o, eps,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EXACT_ROUND: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    out, mask = normed_tile(X, W, rows, cols, n_rows, hidden, stride_x, eps, Out.dtype.element_ty, EXACT_ROUND,
                            R, S, stride_r, stride_s, HAS_RESIDUAL)
    tl.store(Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], out, mask=mask)


def launch_meta(hidden: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS per program, num_warps) for rows of `hidden` values."""
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(16, 2048 // block))  # short rows: several per program
    elems = block * rows
    num_warps = 16 if elems >= 8192 else 8 if elems >= 2048 else 4 if elems >= 512 else 1
    return block, rows, num_warps


def out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the reference's `weight * y` (y in x.dtype): torch's type promotion."""
    return torch.promote_types(weight.dtype, x.dtype)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_triton` takes these inputs (else use `rms_norm_ref`)."""
    return (x.dtype in SUPPORTED_DTYPES and weight.dtype in SUPPORTED_DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and 0 < x.shape[-1] <= MAX_HIDDEN
            and weight.device == x.device)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., hidden] with weight [hidden]; same result as `rms_norm_ref`.

    Returns x's shape in torch.promote_types(weight.dtype, x.dtype) (into `out` when
    given: that shape and dtype, last dimension contiguous).
    """
    if not supported(x, weight):
        raise ValueError(f"rms_norm_triton: unsupported x {tuple(x.shape)} {x.dtype} / weight "
                         f"{tuple(weight.shape)} {weight.dtype} on {x.device} / {weight.device}")
    hidden = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, hidden)  # a view whenever the strides allow
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = out_dtype(x, weight)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {dtype}")
    o2 = out if out.dim() == 2 else out.view(-1, hidden)
    if o2.stride(-1) != 1:
        raise ValueError("out needs a contiguous last dimension")
    _launch(x2, None, None, weight, o2, eps)
    return out


def residual_supported(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the fused residual add (here and in kernels/rms_norm_quant.py) takes x and residual: [M, K] rows of
    one dtype on one device, the last dimension contiguous."""
    return (x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype and x.stride(-1) == 1
            and residual.stride(-1) == 1 and residual.device == x.device)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual): the residual add before a norm in the same kernel, the sum
    rounded to x's dtype as torch's add rounds it; the same result as `add_rms_norm_ref`. x and residual
    [M, hidden] of one dtype (rows may be strided, the last dimension contiguous)."""
    if not (supported(x, weight) and residual_supported(x, residual)):
        raise ValueError(f"add_rms_norm_triton: unsupported x {tuple(x.shape)} {x.dtype} / residual "
                         f"{tuple(residual.shape)} {residual.dtype} / weight {tuple(weight.shape)} {weight.dtype}")
    out = torch.empty(x.shape, dtype=out_dtype(x, weight), device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, summed, weight, out, eps)
    return out, summed


def _launch(x2, residual, summed, weight, out, eps) -> None:
    """The kernel over the rows of x2 (with `residual`: of x2 + residual, stored to `summed`) into `out`."""
    n_rows, hidden = x2.shape
    if n_rows == 0:
        return
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block, rows, num_warps = launch_meta(hidden)
    add = residual is not None
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, residual if add else x2, summed if add else x2, w, out, n_rows, hidden, x2.stride(0),
        residual.stride(0) if add else 0, summed.stride(0) if add else 0, out.stride(0), float(eps),
        BLOCK=block, ROWS=rows, HAS_RESIDUAL=add, EXACT_ROUND=interpreting(), num_warps=num_warps, **launch_options())


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of `add_rms_norm_triton`: the residual add, then the norm of the sum."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
