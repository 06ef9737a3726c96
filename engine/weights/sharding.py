"""Per-rank slices of checkpoint tensors for tensor parallelism, by our parameter names.

`shard_spec(name, full_shape, tp_rank, tp_size)` says which part of a tensor one TP rank
holds: a `SliceSpec` (dim, start, length), or None when the rank holds all of it.

- MLA: q_a_proj, kv_a_proj_with_mqa and every norm replicated; q_b_proj / q_proj and
  kv_b_proj split by heads (their rows are head-major, so a rank's heads are one row range);
  o_proj split by input columns (its partial outputs are summed by one all-reduce).
- Dense MLP and shared experts: gate/up rows, down columns. Routed experts along their
  intermediate size: w13 stacks the gate rows then the up rows, and each half is split on its
  own (a per-expert checkpoint tensor is one half; the stacked [E, 2N, K] parameter is two
  `pieces`); w2 by columns. The router weight and correction bias are replicated.
- embed_tokens / lm_head (and the MTP copies) vocab-parallel: split by rows.
- MTP: the same rules for its decoder layer; enorm, hnorm, eh_proj, shared_head_norm replicated.

Expert parallel (`ep_size` = tp_size): the stacked routed experts w13 / w2 (and their scales) are
split along dim 0, whole experts: rank r holds experts [r * E / ep, (r + 1) * E / ep) with their
full intermediate size. A per-expert checkpoint tensor is then read whole by the rank that owns
the expert (`expert_owner`) and not at all by the others.

DP attention (`attn` = (rank, size) of the attention-TP group): attention weights (q_b / q,
kv_b, o_proj) and the vocab-parallel embed_tokens / lm_head are split over the attention group
only; dense MLPs and experts over the whole group. `group_spec` reads all this from a `TPGroup`.

All-to-all EP (`TPGroup.exchanges_tokens`, --moe-a2a-backend): the shared experts are whole on every rank.

FP8 block scales (`weight_scale_inv`, `w13_scale`, `w2_scale`) are sliced by block index so they
cover exactly the weight slice: weight rows [s, s + L) take scale rows [s // b, ceil((s + L) / b)).
`dequant_slice` dequantises such a pair exactly even when the slice does not start on a block
boundary; engine.distributed.divisibility decides which slices may stay FP8 for the kernels.

`read_slice` reads only a rank's part of a tensor through safetensors' `get_slice`, so no rank
materialises a whole tensor, let alone the whole checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_REPLICATED, _ROWS, _COLS, _VOCAB, _W13, _W2 = "replicated", "rows", "cols", "vocab", "w13", "w2"

_TOP = {
    "embed_tokens": _VOCAB,
    "lm_head": _VOCAB,
    "norm.weight": _REPLICATED,
    # MTP module's own tensors (after the "mtp." prefix)
    "head": _VOCAB,
    "enorm.weight": _REPLICATED,
    "hnorm.weight": _REPLICATED,
    "eh_proj.weight": _REPLICATED,
    "shared_head_norm.weight": _REPLICATED,
}
_LAYER = {
    "input_layernorm.weight": _REPLICATED,
    "post_attention_layernorm.weight": _REPLICATED,
    "self_attn.q_a_proj.weight": _REPLICATED,
    "self_attn.q_a_layernorm.weight": _REPLICATED,
    "self_attn.kv_a_proj_with_mqa.weight": _REPLICATED,
    "self_attn.kv_a_layernorm.weight": _REPLICATED,
    "self_attn.q_b_proj.weight": _ROWS,
    "self_attn.q_proj.weight": _ROWS,
    "self_attn.kv_b_proj.weight": _ROWS,
    "self_attn.o_proj.weight": _COLS,
    "mlp.gate_proj.weight": _ROWS,
    "mlp.up_proj.weight": _ROWS,
    "mlp.down_proj.weight": _COLS,
    "mlp.shared_experts.gate_proj.weight": _ROWS,
    "mlp.shared_experts.up_proj.weight": _ROWS,
    "mlp.shared_experts.down_proj.weight": _COLS,
    "mlp.gate_weight": _REPLICATED,
    "mlp.e_score_correction_bias": _REPLICATED,
    "mlp.w13": _W13,
    "mlp.w2": _W2,
}
_LAYER_PREFIX = re.compile(r"^(?:mtp\.layer\.|layers\.\d+\.)")


@dataclass(frozen=True)
class SliceSpec:
    """Elements [start, start + length) along `dim` of each of `pieces` equal parts of that dim."""

    dim: int
    start: int
    length: int
    pieces: int = 1  # 2 for the stacked w13 parameter: the gate half and the up half

    def local_size(self) -> int:
        return self.length * self.pieces

    def index(self, full_len: int) -> list[slice]:
        """The ranges to take along `dim` (one per piece) from a dim of `full_len` elements."""
        piece = full_len // self.pieces
        return [slice(p * piece + self.start, p * piece + self.start + self.length) for p in range(self.pieces)]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """This slice of a full tensor (a view when there is one piece)."""
        parts = [t[(slice(None),) * self.dim + (s,)] for s in self.index(t.shape[self.dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def is_scale(name: str) -> bool:
    return name.endswith("weight_scale_inv") or name.endswith(("mlp.w13_scale", "mlp.w2_scale"))


def weight_name(scale_name: str) -> str:
    """Our name of the weight a scale belongs to: "...weight_scale_inv" -> "...weight", "mlp.w13_scale" -> "mlp.w13"."""
    if scale_name.endswith("weight_scale_inv"):
        return scale_name[: -len("_scale_inv")]
    return scale_name[: -len("_scale")]


def split_kind(name: str) -> str:
    """How TP splits our parameter `name`: replicated, rows, cols, vocab, w13 or w2 (KeyError if unknown)."""
    if is_scale(name):
        name = weight_name(name)
    key = name[len("mtp."):] if name.startswith("mtp.") and not name.startswith("mtp.layer.") else name
    if key in _TOP:
        return _TOP[key]
    m = _LAYER_PREFIX.match(name)
    if m and name[m.end():] in _LAYER:
        return _LAYER[name[m.end():]]
    raise KeyError(f"no tensor-parallel rule for parameter {name!r} (add it to engine/weights/sharding.py)")


def _weight_spec(kind: str, name: str, shape: Sequence[int], tp_rank: int, tp_size: int) -> SliceSpec:
    nd = len(shape)
    if kind == _VOCAB:
        dim, pieces = 0, 1
    elif kind in (_ROWS, _W13):
        dim, pieces = nd - 2, (2 if kind == _W13 and nd == 3 else 1)
    else:
        dim, pieces = nd - 1, 1
    if nd < 1 or dim < 0:
        raise ValueError(f"{name}: shape {tuple(shape)} has no dim to split")
    piece = shape[dim] // pieces
    if shape[dim] % pieces or piece % tp_size:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(shape)} does not split {tp_size} ways "
                         "(check_model_divisible should have rejected this TP size)")
    length = piece // tp_size
    return SliceSpec(dim, tp_rank * length, length, pieces)


def scale_spec(weight_spec: SliceSpec, weight_shape: Sequence[int], block: tuple[int, int]) -> SliceSpec:
    """The block-scale slice that covers a weight slice (same dim; rows use block[0], columns block[1])."""
    nd = len(weight_shape)
    b = block[0] if weight_spec.dim == nd - 2 else block[1]
    if weight_spec.pieces > 1:
        piece = weight_shape[weight_spec.dim] // weight_spec.pieces
        if piece % b or weight_spec.start % b or weight_spec.length % b:
            raise ValueError(f"a stacked weight of {weight_spec.pieces} x {piece} rows split into {weight_spec.length}"
                             f"-row slices does not split its {b}-row scale blocks: slice the per-expert tensors")
    first = weight_spec.start // b
    last = -(-(weight_spec.start + weight_spec.length) // b)
    return SliceSpec(weight_spec.dim, first, last - first, weight_spec.pieces)


def is_shared_expert(name: str) -> bool:
    """Whether `name` (a weight or its scale) belongs to a MoE layer's shared experts."""
    return ".mlp.shared_experts." in f".{name}"


def is_attention_split(name: str) -> bool:
    """Whether `name` is split over the attention-TP group (attention projections, vocab rows)."""
    return split_kind(name) == _VOCAB or ".self_attn." in f".{name}"


def _expert_spec(name: str, shape: Sequence[int], ep_rank: int, ep_size: int) -> Optional[SliceSpec]:
    """EP: a stacked [E, ...] expert parameter (or scale) -> this rank's whole experts; a per-expert
    checkpoint tensor (2-D) -> None (read whole, by its owner only)."""
    if len(shape) != 3:
        return None
    if shape[0] % ep_size:
        raise ValueError(f"{name}: {shape[0]} experts do not split over --ep-size {ep_size}")
    per = shape[0] // ep_size
    return SliceSpec(0, ep_rank * per, per)


def expert_owner(expert: int, n_experts: int, ep_size: int) -> int:
    """The EP rank that holds routed expert `expert` (of `n_experts`)."""
    return expert // (n_experts // ep_size)


def group_spec(name: str, full_shape: Sequence[int], group, block: Optional[tuple[int, int]] = None,
               weight_shape: Optional[Sequence[int]] = None) -> Optional[SliceSpec]:
    """`shard_spec` for one rank of a `TPGroup` (engine/distributed/groups.py): its TP rank, EP size and
    attention-TP group (DP attention)."""
    attn = group.attention
    if group.exchanges_tokens and is_shared_expert(name):  # all-to-all EP: every rank runs them on its own tokens
        return None
    return shard_spec(name, full_shape, group.rank, group.size, block, weight_shape, ep_size=group.ep_size,
                      attn=(attn.rank, attn.size))


def shard_spec(name: str, full_shape: Sequence[int], tp_rank: int, tp_size: int,
               block: Optional[tuple[int, int]] = None,
               weight_shape: Optional[Sequence[int]] = None, *, ep_size: int = 1,
               attn: Optional[tuple[int, int]] = None) -> Optional[SliceSpec]:
    """The part of tensor `name` (our parameter name, full shape `full_shape`) that TP rank `tp_rank`
    of `tp_size` holds; None when the rank holds it whole (replicated, or tp_size 1).

    For a block-scale name give `block` and `weight_shape` (the full shape of its weight): the
    scale is sliced to cover the weight's slice. `ep_size` (1 or tp_size): routed experts split by
    whole experts; `attn` (rank, size): the attention-TP group of DP attention (default: the TP group).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    kind = split_kind(name)
    if kind in (_W13, _W2) and ep_size > 1:
        return _expert_spec(name, full_shape, tp_rank, ep_size)
    if attn is not None and is_attention_split(name):
        tp_rank, tp_size = attn
    if kind == _REPLICATED or tp_size == 1:
        return None
    if not is_scale(name):
        return _weight_spec(kind, name, full_shape, tp_rank, tp_size)
    if block is None or weight_shape is None:
        raise ValueError(f"{name} is a block scale: pass block and weight_shape (its weight's full shape)")
    wspec = _weight_spec(kind, weight_name(name), weight_shape, tp_rank, tp_size)
    return scale_spec(wspec, weight_shape, block)


def local_shape(name: str, full_shape: Sequence[int], tp_size: int, block: Optional[tuple[int, int]] = None,
                weight_shape: Optional[Sequence[int]] = None, tp_rank: int = 0) -> tuple[int, ...]:
    """Shape of rank `tp_rank`'s part of `name` (what the per-rank model allocates)."""
    spec = shard_spec(name, full_shape, tp_rank, tp_size, block, weight_shape)
    shape = list(full_shape)
    if spec is not None:
        shape[spec.dim] = spec.local_size()
    return tuple(shape)


# ---------------------------------------------------------------------------- reading


def read_slice(handle, tensor_name: str, spec: Optional[SliceSpec]) -> torch.Tensor:
    """Read only `spec`'s part of `tensor_name` from an open safetensors file (`safe_open(..., "pt")`)."""
    sl = handle.get_slice(tensor_name)
    if spec is None:
        return sl[:]
    shape = sl.get_shape()
    lead = (slice(None),) * spec.dim
    parts = [sl[lead + (s,)] for s in spec.index(shape[spec.dim])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, spec.dim)


def read_for_rank(handle, tensor_name: str, param_name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s part of checkpoint tensor `tensor_name`, which fills our parameter `param_name`."""
    shape = handle.get_slice(tensor_name).get_shape()
    return read_slice(handle, tensor_name, shard_spec(param_name, shape, tp_rank, tp_size))


def read_fp8_for_rank(w_handle, w_name: str, s_handle, s_name: str, param_name: str, tp_rank: int, tp_size: int,
                      block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, Optional[SliceSpec]]:
    """Rank `tp_rank`'s part of an FP8 weight and of its block scale: (weight, scale, weight's SliceSpec).

    `param_name` is the weight's parameter name (e.g. "layers.3.mlp.w13" for an expert's
    gate_proj). Pass the weight's spec to `dequant_slice` to dequantise the pair exactly."""
    wshape = w_handle.get_slice(w_name).get_shape()
    wspec = shard_spec(param_name, wshape, tp_rank, tp_size)
    sshape = s_handle.get_slice(s_name).get_shape()
    sspec = None if wspec is None else shard_spec(_scale_name(param_name), sshape, tp_rank, tp_size, block, wshape)
    return read_slice(w_handle, w_name, wspec), read_slice(s_handle, s_name, sspec), wspec


def _scale_name(param_name: str) -> str:
    if param_name.endswith(("mlp.w13", "mlp.w2")):
        return param_name + "_scale"
    return param_name + "_scale_inv"


def block_offset(spec: Optional[SliceSpec], ndim: int, block: tuple[int, int]) -> tuple[int, int]:
    """(row, column) offset of a weight slice inside its first FP8 block: (0, 0) when block-aligned."""
    if spec is None:
        return 0, 0
    if spec.dim == ndim - 2:
        return spec.start % block[0], 0
    if spec.dim == ndim - 1:
        return 0, spec.start % block[1]
    return 0, 0


def dequant_slice(weight: torch.Tensor, scale: torch.Tensor, spec: Optional[SliceSpec], block: tuple[int, int],
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact dequantisation of a weight slice with the scale slice `scale_spec` gave it; the slice may
    start inside a block (offset from `block_offset`). Stacked w13 slices are block-aligned."""
    r0, c0 = block_offset(spec, weight.dim(), block)
    n, k = weight.shape[-2:]
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., r0:r0 + n, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., c0:c0 + k]
    return (weight.float() * s).to(dtype)
