"""RMSNorm fused with the FP8 (e4m3) activation quantisation of the block-FP8 GEMM that reads its output.

    q, scale = rms_norm_quant(x, weight, eps)  ==  per_token_group_quant_fp8(rms_norm_triton(x, weight, eps), 128)

Why: in a decoder layer every RMSNorm but the one before the MoE feeds a block-FP8 GEMM, which first
quantises its input in 1 x 128 groups (a second launch, kernels/fp8.py `per_token_group_quant_fp8`,
unless the tuned config quantises inside the GEMM). One kernel here does both: the normalised row stays
in registers, and what goes to memory is the e4m3 row and its float32 group scales, the operands
`block_fp8_matmul_q` takes.

Bit-equal to the two kernels it replaces (kernels/rms_norm.py's RMSNorm, then kernels/fp8.py's group
quantisation), so switching it on changes no value and no greedy token:
- the normalisation is the RMSNorm kernel's own code (kernels/rms_norm.py `normed_tile`) on that kernel's
  tile ([ROWS, BLOCK], its rows per program and warps: `launch_meta`). The float32 sum of squares is the one
  step whose result depends on the order of its additions, and on the GPU that order follows from the
  tile's layout, so the same tile and warps give the same sum (a [groups, 128] tile with other warps summed
  in another order: one float32 step in the row's scale, then now and then one e4m3 step). In float32 the
  compiler's layout for the fused kernel still differed on an H100 (scales 1 ulp apart at some widths), so
  engine/model/norm_ops.py fuses only bf16 / fp16 activations on a GPU, where the rounding absorbs it;
- the normalised row is rounded to the RMSNorm's output dtype (torch's promotion of x and weight: bf16 for
  a bf16 model) before the group max, as the RMSNorm's output in memory is;
- each group's scale is max|h| / 448 (at least `act_eps` / 448) and q = clamp(h / scale, +-448) rounded
  to e4m3, the very operations of kernels/fp8.py `quant_groups`, on the tile reshaped to
  [ROWS, groups, group] (a max is exact in any order).
Against the torch reference (`rms_norm_quant_ref`: rms_norm_ref, then kernels/fp8_math.py `quantize_groups`)
only the sum of squares differs (torch's own order), as for the RMSNorm kernel.

Rows may be strided (a column slice such as q_a = qkv_a[:, :q_lora_rank] is read in place); the last
dimension must be contiguous. The scales come back as a column-major [M, groups] view (a [groups, M]
buffer), the layout the block GEMM (and cuBLASLt) reads fastest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import round_to_e4m3_grid
from kernels.fp8_math import ACT_EPS, FP8_DTYPE, GROUP_SIZE, cdiv, quantize_groups
from kernels.interpret import interpreting
from kernels.pdl import launch_options, pdl_enter
from kernels.rms_norm import MAX_HIDDEN, SUPPORTED_DTYPES, normed_tile, out_dtype, residual_supported, rms_norm_ref
from kernels.rms_norm import launch_meta as rms_norm_launch_meta  # the same tile: the same sums (see above)

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size
def _rms_norm_quant_kernel(X, R, SUM, W, Q, S, n_rows, hidden, stride_x, stride_r, stride_sum, stride_q, stride_sm,
                           stride_sg, eps, act_eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                           NORM_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EXACT_ROUND: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # kernels/rms_norm.py's tile: the values its kernel would store (kept in float32 registers)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    h, mask = normed_tile(X, W, rows, cols, n_rows, hidden, stride_x, eps, NORM_DTYPE, EXACT_ROUND,
                          R, SUM, stride_r, stride_sum, HAS_RESIDUAL)
    h = h.to(tl.float32)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    # kernels/fp8.py `quant_groups` on [ROWS, groups, GROUP] (masked columns are 0: no group max changes)
    h3 = tl.reshape(h, (ROWS, BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(h3), axis=2), act_eps) / 448.0  # [ROWS, groups]
    q = round_to_e4m3_grid(tl.clamp(h3 / scale[:, :, None], -448.0, 448.0), EXACT_ROUND)
    q = tl.reshape(q, (ROWS, BLOCK))
    tl.store(Q + rows64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(S + rows64[:, None] * stride_sm + g[None, :] * stride_sg, scale,
             mask=row_ok[:, None] & (g * GROUP < hidden)[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor, group: int = GROUP_SIZE) -> bool:
    """Whether `rms_norm_quant` takes these inputs (else norm and quantise apart)."""
    return (x.dtype in SUPPORTED_DTYPES and weight.dtype in SUPPORTED_DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and 0 < x.shape[-1] <= MAX_HIDDEN
            and weight.device == x.device and group > 0 and group & (group - 1) == 0)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = GROUP_SIZE,
                   act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [..., K], flattened) -> (q [M, K] e4m3, scale [M, ceil(K / group)] float32, column-major):
    the block-FP8 GEMM operands of rms_norm(x, weight, eps); the values of kernels/rms_norm.py's RMSNorm
    followed by kernels/fp8.py's `per_token_group_quant_fp8`, bit for bit."""
    if not supported(x, weight, group):
        raise ValueError(f"rms_norm_quant: unsupported x {tuple(x.shape)} {x.dtype} / weight "
                         f"{tuple(weight.shape)} {weight.dtype} on {x.device} / {weight.device}, group {group}")
    hidden = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _launch(x2, None, None, weight, eps, group, act_eps)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       group: int = GROUP_SIZE,
                       act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual add before the norm in the same kernel: (q, scale) of rms_norm(x + residual) as
    `rms_norm_quant` gives them, and x + residual (rounded as torch's add rounds it, the new residual stream).
    x and residual [M, K] of one dtype, the last dimension contiguous."""
    if not (supported(x, weight, group) and residual_supported(x, residual)):
        raise ValueError(f"add_rms_norm_quant: unsupported x {tuple(x.shape)} {x.dtype} / residual "
                         f"{tuple(residual.shape)} {residual.dtype} / weight {tuple(weight.shape)}, group {group}")
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    q, s = _launch(x, residual, summed, weight, eps, group, act_eps)
    return q, s, summed


def _launch(x2, residual, summed, weight, eps, group, act_eps) -> tuple[torch.Tensor, torch.Tensor]:
    m, hidden = x2.shape
    groups = cdiv(hidden, group)
    q = torch.empty((m, hidden), dtype=FP8_DTYPE, device=x2.device)
    s = torch.empty((groups, m), dtype=torch.float32, device=x2.device).t()
    if m == 0:
        return q, s
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block, rows, num_warps = rms_norm_launch_meta(hidden)
    add = residual is not None
    _rms_norm_quant_kernel[(triton.cdiv(m, rows),)](
        x2, residual if add else x2, summed if add else x2, w, q, s, m, hidden, x2.stride(0),
        residual.stride(0) if add else 0, summed.stride(0) if add else 0, q.stride(0), s.stride(0), s.stride(1),
        float(eps), float(act_eps), BLOCK=block, ROWS=rows, GROUP=min(group, block),
        NORM_DTYPE=_TL_DTYPE[out_dtype(x2, weight)], HAS_RESIDUAL=add, EXACT_ROUND=interpreting(),
        num_warps=num_warps, **launch_options())
    return q, s


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = GROUP_SIZE,
                       act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The two steps the kernel fuses, in plain torch: (q [M, K] e4m3, scale [M, groups] float32)."""
    hidden = x.shape[-1]
    return quantize_groups(rms_norm_ref(x, weight, eps).reshape(-1, hidden), group, act_eps)


def add_rms_norm_quant_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           group: int = GROUP_SIZE,
                           act_eps: float = ACT_EPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of `add_rms_norm_quant`: the add, then `rms_norm_quant_ref` of the sum."""
    summed = x + residual
    return (*rms_norm_quant_ref(summed, weight, eps, group, act_eps), summed)
