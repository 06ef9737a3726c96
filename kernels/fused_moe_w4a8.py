"""Fused MoE with INT4 weights and FP8 activations (W4AFP8): the routed experts of `--quantization w4afp8`.

  fused_moe_w4a8(x [T, K], w13 [E, 2N, K/2] int8, w2 [E, K, N/2] int8, topk_ids, topk_weights,
                 w13_scale [E, 2N, K/G1], w2_scale [E, K, N/G2]) -> [T, K]
  out[t] = sum_s w[t, s] * W2[e] @ (silu(G[e] @ x[t]) * (U[e] @ x[t])),  e = topk_ids[t, s]

Weights: symmetric INT4, packed two per byte along K (kernels/int4.py: element 2j in the low nibble),
one float32 scale per (output row, group of G along K); G1 = K / w13_scale.shape[-1],
G2 = N / w2_scale.shape[-1] (each a power of two >= 16). Activations are quantised to e4m3 in
1 x G groups (the weight's group, so each K step of the GEMM has one activation scale and one
weight scale per row); for the swapped GEMM kernel in the order it reads them (each group's even columns,
then its odd ones). The GEMMs and their config keys: kernels/w4a8_gemm.py.

Steps are those of kernels/fused_moe.py (same routing alignment, kernels/moe_align.py, the same
pieces around the GEMM, kernels/moe_common.py, and the same config keys, tuned per GPU by
`dsctl tune-moe --dtype w4afp8`): [align + quantise x in one launch for decode sizes] -> GEMM1 (gate
and up side by side, SiLU*up) -> quantise -> GEMM2 (x routing weight) -> sum over top_k. No host sync:
CUDA-graph safe. Ids outside [0, E) (experts of another EP rank) contribute nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernels.fp8 import per_token_group_quant_fp8
from kernels.fp8_math import dequant_groups, quantize_groups
from kernels.int4 import dequant_int4
from kernels.moe_common import align_and_quant, check_routing, moe_inputs, moe_sum, split_config
from kernels.tuned_configs import get_moe_config
from kernels.w4a8_gemm import act_sums, launch_w4a8_gemm, swapped

DTYPE_NAME = "w4afp8"  # the tuned-config files' dtype= part

# --------------------------------------------------------------------------- reference


def groups(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> tuple[int, int]:
    """(G1, G2): the K groups of the gate_up and down weights, from the packed shapes and their scales."""
    if not w13_scale.shape[2] or not w2_scale.shape[2]:
        raise ValueError(f"INT4 scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} have no K group")
    return 2 * w13.shape[2] // w13_scale.shape[2], 2 * w2.shape[2] // w2_scale.shape[2]


def _act(x: torch.Tensor, group: int, quantize: bool) -> torch.Tensor:
    if not quantize:
        return x.float()
    q, s = quantize_groups(x, group)
    return dequant_groups(q, s, group)


def fused_moe_w4a8_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                       compute_dtype: torch.dtype = torch.float32, quantize: bool = True) -> torch.Tensor:
    """Loop over the experts that received tokens. With `quantize` it mirrors the kernel's roundings
    (e4m3 activations in 1 x G groups, intermediate stored in x.dtype); with quantize=False and
    float64 it is the exact maths of the INT4 weights with unquantised activations."""
    t, k = x.shape
    g1, g2 = groups(w13, w2, w13_scale, w2_scale)
    n = w2.shape[2] * 2
    out = torch.zeros((t, k), dtype=compute_dtype, device=x.device)
    ids = topk_ids.long()
    xa = _act(x, g1, quantize).to(compute_dtype)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xa[tok] @ dequant_int4(w13[e], w13_scale[e], compute_dtype).T
        act = F.silu(h[:, :n]) * h[:, n:]
        if quantize:
            act = _act(act.to(x.dtype), g2, True).to(compute_dtype)
        y = (act @ dequant_int4(w2[e], w2_scale[e], compute_dtype).T) * topk_weights[tok, slot, None].to(compute_dtype)
        if quantize:
            y = y.to(x.dtype).to(compute_dtype)
        out.index_add_(0, tok, y)
    return out if compute_dtype == torch.float64 else out.to(x.dtype)


# --------------------------------------------------------------------------- wrapper


def _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale) -> tuple[int, int, int, int, int, int]:
    t, k = x.shape
    e, two_n, k_half = w13.shape
    n = two_n // 2
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        raise ValueError(f"W4AFP8 weights are packed int8, got {w13.dtype} / {w2.dtype}")
    if 2 * k_half != k or two_n % 2 or tuple(w2.shape) != (e, k, n // 2) or n % 2:
        raise ValueError(f"shapes: x {tuple(x.shape)}, packed w13 {tuple(w13.shape)}, packed w2 {tuple(w2.shape)}")
    if w13_scale.shape[:2] != (e, two_n) or w2_scale.shape[:2] != (e, k):
        raise ValueError(f"scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} do not match the weights")
    check_routing(t, topk_ids, topk_weights)
    g1, g2 = groups(w13, w2, w13_scale, w2_scale)
    for g, dim, s in ((g1, k, w13_scale), (g2, n, w2_scale)):
        if g < 16 or g & (g - 1) or g * s.shape[-1] != dim:
            raise ValueError(f"INT4 group {g} along K = {dim}: must be a power of two >= 16 that tiles K")
    return t, k, e, n, g1, g2


def fused_moe_w4a8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, *, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                   config: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed-experts output [T, K] in x.dtype (see the module docstring). `config` (the keys of
    kernels/fused_moe.py: BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, `<KEY>_DOWN`) defaults
    to the tuned file `dtype=w4afp8` for (E, N, device) at the batch size nearest T, else a default;
    BLOCK_SIZE_K is capped at the INT4 group."""
    t, k, e, n, g1, g2 = _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale)
    inp = moe_inputs(x, topk_ids, topk_weights, out)
    if inp.empty:
        return inp.out.zero_()
    cfg = config or get_moe_config(e, n, t, inp.top_k, DTYPE_NAME, device=x.device)
    up_cfg, down_cfg = split_config(cfg)

    al, a1, a1_s, *a1_sum = align_and_quant(inp.x, inp.ids, e, cfg["BLOCK_SIZE_M"], g1,
                                            deinterleave=swapped(up_cfg, g1), sums=act_sums(up_cfg, g1))
    h = torch.empty((inp.num_valid, n), dtype=inp.inter_dtype, device=x.device)
    launch_w4a8_gemm(a1, a1_s, w13, w13_scale, h, inp.weights, al, group=g1, cfg=up_cfg,
                     a_sum=a1_sum[0] if a1_sum else None, **inp.up_gemm(n, k))
    a2, a2_s, *a2_sum = per_token_group_quant_fp8(h, g2, deinterleave=swapped(down_cfg, g2),
                                                  sums=act_sums(down_cfg, g2))
    y = torch.empty((inp.num_valid, k), dtype=inp.inter_dtype, device=x.device)
    launch_w4a8_gemm(a2, a2_s, w2, w2_scale, y, inp.weights, al, group=g2, cfg=down_cfg,
                     a_sum=a2_sum[0] if a2_sum else None, **inp.down_gemm(n, k))
    return moe_sum(y, inp, e)


__all__ = ["DTYPE_NAME", "fused_moe_w4a8", "fused_moe_w4a8_ref", "groups"]
