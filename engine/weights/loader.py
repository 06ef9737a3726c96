"""Load a Hugging Face DeepSeek checkpoint (sharded safetensors) into the engine's modules.

HF names map onto our modules (`hf_to_target`): per-expert weights are stacked
into the MoE's w13 / w2 (and their FP8 block scales). FP8 tensors are either kept
(W8A8 path) or dequantised exactly; plain tensors loaded into FP8 targets are
block-quantised (both with kernels/fp8_math.py). Every target must be filled: anything missing is reported as
one `CheckpointError` listing every missing tensor.

Tensor parallelism: given a rank's `TPGroup`, every tensor is read through safetensors'
`get_slice` as only that rank's part (engine/weights/sharding.py's rules, by our parameter
name), FP8 block scales as the blocks that cover it; no whole split tensor is ever read.
A sliced FP8 weight is dequantised with `dequant_slice` (exact even inside a block), kept
FP8 as it is, or, from a plain checkpoint, quantised per rank. Under expert parallelism a rank
reads only the per-expert tensors (and FP8 scales) of the experts it owns, whole, into its local
expert index; under DP attention attention weights and the vocab rows are sliced over the
attention-TP group.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch
from safetensors import safe_open

from engine.checkpoint.config import ModelConfig
from engine.distributed.groups import TPGroup
from engine.errors import CheckpointError
from engine.weights.sharding import SliceSpec, dequant_slice, expert_owner, group_spec, read_slice, scale_spec
from engine.weights.w4afp8 import is_int4_param, load_int4_expert
from kernels.fp8_math import FP8_DTYPE, cdiv, dequant_block_fp8, quantize_block_fp8

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "eh_proj.weight_scale_inv": "eh_proj.weight_scale_inv",
    "shared_head.norm.weight": "shared_head_norm.weight",
    "shared_head.head.weight": "head",
    "embed_tokens.weight": "embed_tokens",
}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter name, optionally an expert slice."""

    name: str  # our parameter name (prefix "mtp." for the MTP module)
    expert: Optional[int] = None
    part: Optional[str] = None  # gate | up | down


def weight_map(ckpt: Path) -> dict[str, str]:
    """Tensor name -> shard file name."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = ckpt / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise CheckpointError(f"{ckpt} has neither model.safetensors.index.json nor model.safetensors")


def has_mtp(names, cfg: ModelConfig) -> bool:
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return cfg.num_nextn_predict_layers > 0 and any(n.startswith(prefix) for n in names)


def has_mtp_layer(config: ModelConfig, checkpoint: Optional[Path]) -> bool:
    """Whether the MTP layer can be built: the config has one and the checkpoint (if any) ships it."""
    if not config.num_nextn_predict_layers:
        return False
    if checkpoint is None:
        return True
    return has_mtp(weight_map(checkpoint), config)


def _layer_target(prefix: str, rest: str) -> Target:
    m = _EXPERT.match(rest)
    if m:
        e, part, kind = int(m.group(1)), m.group(2), m.group(3)
        stack = "w2" if part == "down" else "w13"
        return Target(f"{prefix}mlp.{stack}{'_scale' if kind == 'weight_scale_inv' else ''}", int(e), part)
    rest = rest.replace("mlp.gate.weight", "mlp.gate_weight").replace(
        "mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")
    return Target(prefix + rest)


def hf_to_target(name: str, cfg: ModelConfig, num_layers: int, mtp: bool) -> Optional[Target]:
    """Our target for an HF tensor name, or None when it is not used (truncated layers)."""
    top = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head", "model.norm.weight": "norm.weight"}
    if name in top:
        return Target(top[name])
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if mtp and i == cfg.num_hidden_layers:
        if rest in _MTP_OWN:
            return Target("mtp." + _MTP_OWN[rest])
        return _layer_target("mtp.layer.", rest)
    if i < num_layers:
        return _layer_target(f"layers.{i}.", rest)
    return None


class _Shards:
    """The checkpoint's shard files, opened on first use, read as one TP rank's slices."""

    def __init__(self, ckpt: Path, wmap: dict[str, str], tp: TPGroup):
        self.ckpt, self.wmap, self._open = ckpt, wmap, {}
        self.tp = tp

    def handle(self, name: str):
        fname = self.wmap[name]
        if fname not in self._open:
            try:
                self._open[fname] = safe_open(str(self.ckpt / fname), framework="pt")
            except Exception as exc:  # noqa: BLE001 - report any unreadable shard clearly
                raise CheckpointError(f"cannot read shard {fname}: {exc}") from None
        return self._open[fname]

    def read(self, name: str, param: str, block: tuple[int, int]
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[SliceSpec]]:
        """This rank's part of checkpoint tensor `name`, which fills our parameter `param`:
        (tensor, its FP8 scale slice or None, the tensor's SliceSpec or None when read whole)."""
        handle = self.handle(name)
        shape = handle.get_slice(name).get_shape()
        try:
            spec = group_spec(param, shape, self.tp)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None
        src = read_slice(handle, name, spec)
        if src.dtype != FP8_DTYPE:
            return src, None, spec
        sname = name[: -len("weight")] + "weight_scale_inv"
        if sname not in self.wmap:
            raise CheckpointError(f"FP8 tensor {name} has no {sname} in the checkpoint")
        sspec = None if spec is None else scale_spec(spec, shape, block)
        return src, read_slice(self.handle(sname), sname, sspec), spec


def _expert_slice(param: torch.Tensor, t: Target, n_rows: int) -> torch.Tensor:
    """View of param[e] for an expert part; n_rows = rows of the gate half (N, or N/block for scales)."""
    dst = param[t.expert]
    if t.part == "gate":
        return dst[:n_rows]
    if t.part == "up":
        return dst[n_rows:]
    return dst


def _convert(src: torch.Tensor, scale: Optional[torch.Tensor], dst: torch.Tensor, block,
             spec: Optional[SliceSpec] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Bring a checkpoint tensor (a TP slice when `spec` is given) to the destination's dtype
    (dequantise or quantise FP8 as needed)."""
    if src.dtype == FP8_DTYPE and dst.dtype != FP8_DTYPE:
        if spec is None:
            return dequant_block_fp8(src, scale, block, dst.dtype), None
        return dequant_slice(src, scale, spec, block, dst.dtype), None
    if src.dtype != FP8_DTYPE and dst.dtype == FP8_DTYPE:
        return quantize_block_fp8(src, block)
    return src.to(dst.dtype), scale


def load_checkpoint(modules: dict[str, torch.nn.Module], ckpt: Path, cfg: ModelConfig, num_layers: int,
                    block: tuple[int, int], tp: TPGroup, placed: Optional[Mapping[str, Sequence[int]]] = None) -> None:
    """Fill the parameters of modules {"": main model, "mtp.": MTP layer or absent} from ckpt.

    block: the checkpoint's FP8 block (and the block plain weights are quantised to for FP8 targets).
    tp: the TP group the modules were built for (size 1: unsplit); only this rank's slices are read.
    placed: under an expert placement, each placed expert parameter's name -> the logical expert of each of its
    slots (a checkpoint expert then fills every slot that holds it; engine/distributed/expert_placement.py)."""
    wmap = weight_map(ckpt)
    mtp = "mtp." in modules
    params = {prefix + k: v for prefix, mod in modules.items() for k, v in mod.named_parameters()}
    filled: set[tuple[str, Optional[int], Optional[str]]] = set()
    shards = _Shards(ckpt, wmap, tp)
    for name in wmap:
        if name.endswith("weight_scale_inv"):
            continue  # consumed together with its weight
        targets = _local(hf_to_target(name, cfg, num_layers, mtp), cfg, tp, placed or {})
        if not targets or targets[0].name not in params:
            continue
        if targets[0].expert is not None and is_int4_param(params[targets[0].name]):  # W4AFP8 experts (w4afp8.py)
            for t in targets:
                load_int4_expert(shards, name, t, params, cfg.experts_int4_group, block, filled)
            continue
        src, scale, spec = shards.read(name, targets[0].name, block)
        for t in targets:
            _store(params, t, src, scale, block, filled, spec)
    _share_mtp_embeddings(modules, filled)
    if cfg.tie_word_embeddings and ("embed_tokens", None, None) in filled:
        modules[""].lm_head = modules[""].embed_tokens
        filled.add(("lm_head", None, None))
    missing = sorted(_expected(params, cfg, modules) - filled, key=str)
    if missing:
        lines = [_describe(m) for m in missing]
        head = f"{ckpt}: {len(lines)} tensor(s) missing from the checkpoint"
        raise CheckpointError("\n  ".join([head, *lines[:50]] + (["..."] if len(lines) > 50 else [])))


def _local(t: Optional[Target], cfg: ModelConfig, tp: Optional[TPGroup],
           placed: Mapping[str, Sequence[int]]) -> list[Target]:
    """EP: the target with its expert renumbered to this rank's local slot (under a placement: every local slot
    holding it), or [] for another rank's expert (not read at all). Without EP: [t]; [] for no target."""
    if t is None:
        return []
    if t.expert is None or tp is None or tp.ep_size == 1:
        return [t]
    if t.name in placed:
        return [Target(t.name, j, t.part) for j, e in enumerate(placed[t.name]) if e == t.expert]
    if expert_owner(t.expert, cfg.n_routed_experts, tp.ep_size) != tp.ep_rank:
        return []
    return [Target(t.name, t.expert - tp.ep_rank * (cfg.n_routed_experts // tp.ep_size), t.part)]


def _store(params, t: Target, src, scale, block, filled, spec: Optional[SliceSpec] = None) -> None:
    param = params[t.name]
    if t.expert is None:
        value, new_scale = _convert(src, scale, param, block, spec)
        if value.shape != param.shape:
            raise CheckpointError(f"{t.name}: checkpoint shape {tuple(value.shape)} != expected {tuple(param.shape)}")
        param.data.copy_(value)
        filled.add((t.name, None, None))
        _store_scale(params, t.name, new_scale, filled)
        return
    n_rows = param.shape[-2] // 2 if t.part != "down" else 0  # this rank's gate (= up) rows of w13
    dst = _expert_slice(param, t, n_rows)
    value, new_scale = _convert(src, scale, dst, block, spec)
    if value.shape != dst.shape:
        raise CheckpointError(f"{t.name} expert {t.expert} {t.part}: checkpoint shape {tuple(value.shape)} "
                              f"!= expected {tuple(dst.shape)}")
    dst.copy_(value)
    filled.add((t.name, t.expert, t.part))
    if new_scale is not None:
        sdst = _expert_slice(params[t.name + "_scale"], t, cdiv(n_rows, block[0]))
        if new_scale.shape != sdst.shape:
            raise CheckpointError(f"{t.name}_scale expert {t.expert} {t.part}: checkpoint scale shape "
                                  f"{tuple(new_scale.shape)} != expected {tuple(sdst.shape)}")
        sdst.copy_(new_scale)
        filled.add((t.name + "_scale", t.expert, t.part))


def _store_scale(params, name: str, scale, filled) -> None:
    sname = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
    if scale is not None and sname in params:
        if scale.shape != params[sname].shape:
            raise CheckpointError(f"{sname}: checkpoint scale shape {tuple(scale.shape)} != expected "
                                  f"{tuple(params[sname].shape)}")
        params[sname].data.copy_(scale)
        filled.add((sname, None, None))


def _share_mtp_embeddings(modules, filled) -> None:
    mtp = modules.get("mtp.")
    if mtp is None:
        return
    if ("mtp.embed_tokens", None, None) not in filled:
        mtp.embed_tokens = modules[""].embed_tokens
    if ("mtp.head", None, None) not in filled:
        mtp.head = modules[""].lm_head


def _expected(params, cfg: ModelConfig, modules) -> set:
    want = set()
    for name in params:
        if re.search(r"mlp\.w(13|2)(_scale)?$", name):
            parts = ("down",) if ".w2" in name else ("gate", "up")
            want |= {(name, e, part) for e in range(params[name].shape[0]) for part in parts}  # local experts
        elif not (name.startswith("mtp.") and name in ("mtp.embed_tokens", "mtp.head")):
            want.add((name, None, None))
    return want


def _describe(key) -> str:
    name, expert, part = key
    hf = name.replace("mtp.", "model.layers.<mtp>.").replace("layers.", "model.layers.", 1)
    if expert is not None:
        stem = re.sub(r"mlp\.w(13|2)(_scale)?$", "", name)
        kind = "weight_scale_inv" if name.endswith("_scale") else "weight"
        return f"{stem}mlp.experts.{expert}.{part}_proj.{kind}"
    return hf


def iter_params(modules) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for prefix, mod in modules.items():
        for k, v in mod.named_parameters():
            yield prefix + k, v
