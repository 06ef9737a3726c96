"""Building blocks: RMSNorm, linear layers (plain or block-FP8 weights), dense MLP, and the
tensor-parallel pieces (the TP group of an unsplit model, per-rank sizes, vocab-parallel
embedding and logits).

Block-FP8 shapes and dequantisation come from kernels/fp8_math.py. The kernels each module runs
(the block-FP8 GEMM, RMSNorm, the all-reduce) are the `Kernels` it is given at construction
(engine/model/kernel_set.py; default: the torch reference of each). Collectives at TP size 1
return their input untouched, so the unsplit model runs exactly as before.

An RMSNorm whose output only block-FP8 linears read (`RMSNorm.for_linear`) may hand them an `FP8Input`
instead, the quantised activation of `kernels.norm_quant` (one kernel for the norm and the GEMM's FP8
quantisation), which `Linear` multiplies with `kernels.gemm_q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import comm
from engine.distributed.groups import TPGroup
from engine.model.kernel_set import REFERENCE, AllReduce, Kernels
from kernels.fp8_math import FP8_DTYPE, block_scale_shape, dequant_block_fp8


def solo_group() -> TPGroup:
    """The TP group of an unsplit model: size 1, no torch.distributed (every collective is a no-op)."""
    return TPGroup(rank=0, size=1, ranks=(0,))


def tp_local(full: int, tp: TPGroup, what: str) -> int:
    """`full` / tp.size: this rank's share of a split dimension (ValueError when it does not divide;
    the model's constructor runs check_model_divisible first, which says which TP sizes work)."""
    if full % tp.size:
        raise ValueError(f"{what} = {full} does not split {tp.size} ways")
    return full // tp.size


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tp: TPGroup,
                             all_reduce: AllReduce = comm.all_reduce) -> torch.Tensor:
    """Embedding lookup with `weight` holding this rank's vocab rows [rank * V/tp, (rank + 1) * V/tp):
    ids outside them give zero rows, and the all-reduce adds the one rank's row that is not zero."""
    if tp.size == 1:
        return F.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    return all_reduce(out, tp)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """float32 logits over the whole vocabulary on every rank: this rank's vocab rows of the head,
    then an all-gather in rank (= vocabulary) order."""
    return comm.all_gather_last_dim(F.linear(hidden, weight), tp).float()


@dataclass(frozen=True)
class FP8Input:
    """An activation quantised for block-FP8 linears: q [M, K] e4m3 and its 1 x group float32 scales
    [M, ceil(K / group)]; `dtype` is that of the activation it stands for (the linears' output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


Activation = Union[torch.Tensor, FP8Input]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does), by
    `kernels.rms_norm`."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, kernels: Kernels = REFERENCE):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def for_linear(self, x: torch.Tensor, *linears: "Linear") -> Activation:
        """The norm of x [M, K] for `linears`, its only readers: quantised by the fused kernel
        (`kernels.norm_quant`) when every one is a block-FP8 linear of the same K group, else the norm."""
        group = _fp8_group(linears) if self.kernels.norm_quant is not None and x.dim() == 2 else None
        pair = self.kernels.norm_quant(x, self.weight, self.eps, group) if group else None
        if pair is None:  # the kernel does not run here (torch.compile, an input it does not take)
            return self(x)
        return FP8Input(*pair, torch.promote_types(self.weight.dtype, x.dtype))

    def add(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual): a decoder layer's residual add and this norm in one kernel
        (`kernels.add_rms_norm`); with residual None, (the norm of x, x)."""
        if residual is None:
            return self(x), x
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def add_for_linear(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                       *linears: "Linear") -> tuple[Activation, torch.Tensor]:
        """`add`, the norm for `linears` as `for_linear` gives it (quantised with the add by
        `kernels.add_norm_quant` where that runs)."""
        if residual is None:
            return self.for_linear(x, *linears), x
        group = _fp8_group(linears) if self.kernels.add_norm_quant is not None else None
        fused = self.kernels.add_norm_quant(x, residual, self.weight, self.eps, group) if group else None
        if fused is None:
            return self.add(x, residual)
        q, scale, summed = fused
        return FP8Input(q, scale, torch.promote_types(self.weight.dtype, x.dtype)), summed


def _fp8_group(linears: tuple["Linear", ...]) -> Optional[int]:
    """The activation group (block K) of `linears` when every one is a block-FP8 linear of the same block, else
    None (a norm feeding them may then hand them its quantised output)."""
    blocks = {lin.fp8_block for lin in linears}
    return None if len(blocks) != 1 or None in blocks else next(iter(blocks))[1]


class Linear(nn.Module):
    """y = x @ W.T with W either in the model dtype or block-FP8 (+ float32 weight_scale_inv; the product
    is then `kernels.gemm`)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 fp8_block: tuple[int, int] | None = None, kernels: Kernels = REFERENCE):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8_block = fp8_block
        self.kernels = kernels
        if fp8_block is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            self.weight_scale_inv = None
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
            scale_shape = block_scale_shape((out_features, in_features), fp8_block)
            self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in a plain dtype (dequantised when FP8)."""
        if self.fp8_block is None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return dequant_block_fp8(self.weight, self.weight_scale_inv, self.fp8_block, dtype)

    def forward(self, x: Activation) -> torch.Tensor:
        if isinstance(x, FP8Input):  # RMSNorm.for_linear quantised it (only for block-FP8 weights)
            return self.kernels.gemm_q(x.q, x.scale, self.weight, self.weight_scale_inv, self.fp8_block, x.dtype)
        if self.fp8_block is None:
            return F.linear(x, self.weight)
        return self.kernels.gemm(x, self.weight, self.weight_scale_inv, self.fp8_block)


def stacked(first: Linear, second: Linear, kernels: Kernels) -> Optional[Linear]:
    """One Linear whose output rows are first's then second's (one GEMM for two that read the same input), or
    None where FP8 scale blocks would straddle the two: first's rows must be whole blocks, so that second's
    scale rows start on a block boundary (second's last block may be partial)."""
    block = first.fp8_block
    if block is not None and first.out_features % block[0]:
        return None
    with torch.device("meta"):  # shapes only: the parameters are replaced just below
        merged = Linear(first.in_features, first.out_features + second.out_features, first.weight.dtype, block,
                        kernels)
    merged.weight = nn.Parameter(torch.cat([first.weight, second.weight]), requires_grad=False)
    if block is not None:
        merged.weight_scale_inv = nn.Parameter(torch.cat([first.weight_scale_inv, second.weight_scale_inv]),
                                               requires_grad=False)
    return merged


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)).

    Under TP, gate / up hold this rank's `inter / tp` rows and down the matching columns, so the
    output is a partial sum: `reduce` sums it over the group (a dense layer); the MoE's shared
    experts pass reduce=False and are summed together with the routed experts.

    Weights load into gate_proj / up_proj (the checkpoint's tensors, sliced per rank); `merge_gate_up`
    (run by the model builder after loading) then stacks them into one gate_up_proj of 2 x local rows,
    so a forward runs one GEMM (one FP8 activation quantisation) instead of two, with the shape the
    tuned configs are made for (tuning/shapes.py: "mlp.gate_up_proj")."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fp8_block=None,
                 tp: Optional[TPGroup] = None, reduce: bool = True, kernels: Kernels = REFERENCE):
        super().__init__()
        self.tp, self.reduce = tp or solo_group(), reduce
        self.kernels = kernels
        self.local = local = tp_local(inter, self.tp, "MLP intermediate size")
        self.gate_proj = Linear(hidden, local, dtype, fp8_block, kernels)
        self.up_proj = Linear(hidden, local, dtype, fp8_block, kernels)
        self.down_proj = Linear(local, hidden, dtype, fp8_block, kernels)
        self.gate_up_proj: Optional[Linear] = None

    def merge_gate_up(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj holding both (gate rows first). FP8 weights
        merge when the rows are whole scale blocks (every shape that runs FP8: check_model_divisible)."""
        merged = stacked(self.gate_proj, self.up_proj, self.kernels)
        if merged is None:
            return  # a scale block would straddle the two halves: keep them apart
        del self.gate_proj, self.up_proj
        self.gate_up_proj = merged

    def input_linears(self) -> tuple[Linear, ...]:
        """The linears that read the MLP's input (for RMSNorm.for_linear)."""
        return (self.gate_up_proj,) if self.gate_up_proj is not None else (self.gate_proj, self.up_proj)

    def forward(self, x: Activation) -> torch.Tensor:
        if self.gate_up_proj is not None:
            h = self.activation(self.gate_up_proj(x))
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        out = self.down_proj(h)
        return self.kernels.all_reduce(out, self.tp) if self.reduce else out

    def activation(self, gate_up: torch.Tensor) -> Activation:
        """SiLU(gate) * up of the merged GEMM's output, for down_proj: quantised with it in one kernel
        (`kernels.act_quant`) when down_proj is block-FP8, else the torch form (down_proj then quantises)."""
        block = self.down_proj.fp8_block
        if self.kernels.act_quant is not None and block is not None:
            pair = self.kernels.act_quant(gate_up, block[1])
            if pair is not None:
                return FP8Input(*pair, gate_up.dtype)
        gate, up = gate_up.split(self.local, dim=-1)
        return F.silu(gate) * up
