"""W4AFP8 routed experts from a checkpoint: a published W4AFP8 checkpoint, or quantised at load time.

Our MoE holds INT4 experts (engine/model/moe.py, kernels/int4.py) when the config says so. Each
per-expert checkpoint tensor `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` fills its
part of w13 / w2 and w13_scale / w2_scale from either source:

- pre-quantised (the layout SGLang's `w4afp8` method reads, e.g. Barrrrry/DeepSeek-R1-W4AFP8;
  docs/quantization.md): the weight is int8 [out, in / 2], two int4 per byte along `in` (element
  2j in the low nibble), with `weight_scale_inv` float32 [out, in / G] (a multiplier, G = 128); the
  per-expert `input_scale` (a static activation scale) is not read: activations are quantised per
  token group at run time;
- online: a block-FP8 (or bf16) weight is dequantised exactly and quantised to INT4 in groups of G
  along `in` (kernels/int4.py), so the official FP8 checkpoint needs no second download.

Both give the same bytes for the same weights: the online path quantises whole groups of the
whole tensor exactly as a pre-quantiser would, then keeps the rank's part. Tensor parallelism:
gate/up rows are split with their scale rows; down_proj columns (its K) are split, a rank reading
the group-aligned column range that covers its slice and keeping its columns and their groups' scales
(N/tp inside one group: that group's one scale). Under EP a rank reads its own experts whole.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.errors import CheckpointError, UsageError
from engine.weights.sharding import SliceSpec, dequant_slice, group_spec, read_slice, scale_spec
from kernels.fp8_math import FP8_DTYPE, cdiv
from kernels.int4 import quantize_int4

INT8_NAMES = ("I8", "int8")  # safetensors' dtype name of a packed INT4 tensor


def is_int4_param(param: torch.Tensor) -> bool:
    """Whether an expert parameter holds packed INT4 (the MoE's W4AFP8 w13 / w2)."""
    return param.dtype == torch.int8


def _aligned(spec: Optional[SliceSpec], k: int, group: int) -> tuple[int, int]:
    """The group-aligned range [lo, hi) of K columns that covers a column slice (all of K when unsplit)."""
    if spec is None or spec.dim == 0:
        return 0, k
    return spec.start // group * group, cdiv(spec.start + spec.length, group) * group


def _read_int4(handle, name: str, rows: Optional[SliceSpec], lo: int, hi: int, group: int):
    """A pre-quantised tensor's rows (None: all) and K columns [lo, hi) (only those read) -> (packed, scales)."""
    sname = name[: -len("weight")] + "weight_scale_inv"
    k = 2 * handle.shape[1]
    sshape = handle.scales.get_slice(sname).get_shape()
    if len(sshape) != 2 or sshape[1] * group != k:
        raise CheckpointError(f"{sname}: shape {tuple(sshape)} is not one scale per {group} of {k} columns")
    if (lo, hi) != (0, k):
        return (read_slice(handle.weights, name, SliceSpec(1, lo // 2, (hi - lo) // 2)),
                read_slice(handle.scales, sname, SliceSpec(1, lo // group, (hi - lo) // group)))
    return read_slice(handle.weights, name, rows), read_slice(handle.scales, sname, rows)


def _quantise(handle, name: str, rows: Optional[SliceSpec], lo: int, hi: int, k: int, group: int, block, device):
    """A float / block-FP8 tensor's rows (None: all) and K columns [lo, hi), quantised on `device` (the
    parameter's: DeepSeek-V3 has ~44k expert tensors per rank, which a GPU quantises far faster than the host;
    the dequantisation is one correctly rounded float32 product per element and `quantize_int4` is exact in
    float64, so either gives the same bytes) -> (packed, scales)."""
    full_shape = handle.weights.get_slice(name).get_shape()
    spec = rows if rows is not None else (SliceSpec(1, lo, hi - lo) if (lo, hi) != (0, k) else None)
    w = read_slice(handle.weights, name, spec).to(device)
    if w.dtype == FP8_DTYPE:
        sname = name[: -len("weight")] + "weight_scale_inv"
        sspec = None if spec is None else scale_spec(spec, full_shape, block)
        w = dequant_slice(w, read_slice(handle.scales, sname, sspec).to(device), spec, block)
    return quantize_int4(w.float(), group)


class ExpertTensor:
    """The open safetensors handles of one expert weight and of its scale (the shard each lives in)."""

    def __init__(self, weights, scales, dtype: str, shape):
        self.weights, self.scales, self.dtype, self.shape = weights, scales, dtype, tuple(shape)

    @property
    def packed(self) -> bool:
        return self.dtype in INT8_NAMES

    @property
    def k(self) -> int:
        return self.shape[1] * (2 if self.packed else 1)


def read_int4_expert(t: ExpertTensor, name: str, param_name: str, group: int, block, tp, device="cpu"):
    """This rank's (packed int8 [rows, K_local / 2], float32 scales [rows, K_local / G_local]) of one
    expert weight, from either source; `param_name` (our w13 / w2) picks the TP split."""
    rows_total = t.shape[0]
    try:
        spec = group_spec(param_name, (rows_total, t.k), tp)
    except ValueError as exc:
        raise CheckpointError(f"{name}: {exc}") from None
    rows = spec if spec is not None and spec.dim == 0 else None
    lo, hi = _aligned(spec, t.k, group)
    if t.packed:
        packed, scale = _read_int4(t, name, rows, lo, hi, group)
    else:
        packed, scale = _quantise(t, name, rows, lo, hi, t.k, group, block, device)
    if spec is None or spec.dim == 0:
        return packed, scale
    s, n = spec.start - lo, spec.length  # this rank's columns inside the aligned range
    return packed[:, s // 2:(s + n) // 2], scale[:, s // group:cdiv(s + n, group)]


def store_int4_expert(params: dict, t, packed: torch.Tensor, scale: torch.Tensor, filled: set) -> None:
    """Copy one expert part (t: the loader's Target) into w13 / w2 and its scale; mark both filled."""
    for pname, value in ((t.name, packed), (t.name + "_scale", scale)):
        dst = params[pname][t.expert]
        if t.part != "down":
            half = dst.shape[0] // 2
            dst = dst[:half] if t.part == "gate" else dst[half:]
        if value.shape != dst.shape:
            raise CheckpointError(f"{pname} expert {t.expert} {t.part}: W4AFP8 shape {tuple(value.shape)} != "
                                  f"expected {tuple(dst.shape)}")
        dst.copy_(value)
        filled.add((pname, t.expert, t.part))


def load_int4_expert(shards, name: str, t, params: dict, group: int, block, filled: set) -> None:
    """Fill the INT4 expert part that checkpoint tensor `name` holds (t: the loader's Target for it), read
    through the loader's shards (`handle(name)`, `wmap`, `tp`)."""
    handle = shards.handle(name)
    sl = handle.get_slice(name)
    sname = name[: -len("weight")] + "weight_scale_inv"
    scales = shards.handle(sname) if sname in shards.wmap else None
    et = ExpertTensor(handle, scales, sl.get_dtype(), sl.get_shape())
    if scales is None and (et.packed or et.dtype.startswith("F8")):
        raise CheckpointError(f"{name} ({et.dtype}) has no {sname} in the checkpoint")
    packed, scale = read_int4_expert(et, name, t.name, group, block, shards.tp, params[t.name].device)
    store_int4_expert(params, t, packed, scale, filled)


def int4_scale_block(weight_shape, scale_shape) -> tuple[int, int]:
    """The (rows, packed columns) block one INT4 scale covers, for slicing scales like their weights."""
    return 1, weight_shape[-1] // scale_shape[-1]


def with_int4_experts(config: ModelConfig, quantization: Optional[str]) -> ModelConfig:
    """The model config the weights are built for under --quantization: `w4afp8` makes the routed experts
    INT4 (a W4AFP8 checkpoint already has them; 'none' cannot dequantise those)."""
    if config.experts_int4_group and quantization in ("none", "fp8"):
        raise UsageError(f"--quantization {quantization}: this checkpoint's routed experts are INT4 (W4AFP8) and "
                         "cannot be served otherwise; drop the flag")
    if quantization != "w4afp8" or config.experts_int4_group:
        return config
    if not config.n_routed_experts:
        raise UsageError("--quantization w4afp8 makes the routed experts INT4, and this model has none")
    return config.with_int4_experts()


def check_int4_split(config: ModelConfig, quantization: Optional[str], tp_size: int, ep_size: int = 1) -> None:
    """Before any weight is read: UsageError when the flags' W4AFP8 experts cannot split over the TP ranks
    (a rank's share of moe_intermediate_size must hold whole INT4 groups or lie inside one)."""
    cfg = with_int4_experts(config, quantization)
    group = cfg.experts_int4_group
    if not group:
        return
    n = cfg.moe_intermediate_size // (tp_size if ep_size == 1 else 1)
    if cfg.hidden_size % group or (n % group and group % n):
        raise UsageError(f"W4AFP8: hidden_size {cfg.hidden_size} and the per-rank moe_intermediate_size {n} must "
                         f"hold whole INT4 groups of {group} (or the latter lie inside one); use another --tp, or "
                         "--ep-size (whole experts per rank)")
