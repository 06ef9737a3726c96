"""Build one rank's DeepSeek model (and its MTP layer) and fill its weights, in one call.

`build_model` is what a model runner calls on every TP rank, with that rank's `TPGroup`
(None or size 1: the unsplit model):

1. the TP size is checked against the model (heads, intermediate sizes, vocab and, for
   weights kept FP8, the 128 x 128 blocks: `check_model_divisible`), before anything is
   allocated;
2. the modules are built on `device` holding only this rank's shards;
3. weights come from the checkpoint, each rank reading only its slices
   (engine/weights/loader.py), or are dummy weights equal to the rank's slice of the TP-1
   dummy weights (engine/weights/dummy.py);
4. MLA's absorbed w_kc / w_vc are derived from the rank's kv_b_proj heads, and each dense MLP's
   gate and up projections are stacked into one (`MLP.merge_gate_up`), and so are MLA's q_a and kv_a
   projections (`MLA.merge_qkv_a`).

Every module runs the `Kernels` given (engine/model/kernel_set.py: what the runner resolved with the
kernel registry); without them, what 'auto' picks for `device` (engine/model/kernel_registry.py).

The MTP/NextN layer is built when the config has one and the checkpoint ships it (dummy
weights always have it), with its own KV-cache layer right after the decoder layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.distributed.expert_placement import ExpertPlacement
from engine.distributed.groups import TPGroup
from engine.model.deepseek import DeepseekForCausalLM, MTPLayer
from engine.model.kernel_registry import KernelSetup, auto_kernels
from engine.model.kernel_set import REFERENCE, Kernels
from engine.model.layers import MLP, solo_group
from engine.model.moe import MoE
from engine.weights.dummy import fill_dummy
from engine.weights.loader import has_mtp_layer, iter_params, load_checkpoint
from kernels.fp8_math import WEIGHT_BLOCK
from kernels.interpret import interpreting


def make_modules(config: ModelConfig, num_layers: int, dtype: torch.dtype, fp8_block=None,
                 tp: Optional[TPGroup] = None, mtp: bool = True, kernels: Kernels = REFERENCE,
                 placement: Optional[ExpertPlacement] = None) -> dict[str, torch.nn.Module]:
    """{"": the model, "mtp.": its MTP layer (when `mtp`)} for one rank, weights unfilled (on the
    current default device: wrap in `with torch.device(...)`, "meta" for shapes only); placement: where the
    routed experts live under EP (None: the plain layout)."""
    cfg = config.with_num_layers(num_layers)
    modules: dict[str, torch.nn.Module] = {"": DeepseekForCausalLM(cfg, dtype, fp8_block, tp, kernels, placement)}
    if mtp:
        modules["mtp."] = MTPLayer(cfg, num_layers, dtype, fp8_block,
                                   moe=config.is_moe_layer(config.num_hidden_layers), tp=tp, kernels=kernels,
                                   placement=placement, layer=config.num_hidden_layers)
    return modules


def placed_experts(modules: dict[str, torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Each expert parameter of a MoE with a placement -> the logical expert of each of its local slots (what
    the loader and the dummy weights fill each slot with)."""
    placed = {}
    for prefix, mod in modules.items():
        for name, m in mod.named_modules():
            if isinstance(m, MoE) and m.slots:
                for p in ("w13", "w2", "w13_scale", "w2_scale"):
                    if getattr(m, p) is not None:
                        placed[f"{prefix}{name}.{p}"] = m.local_experts()
    return placed


def full_shapes(config: ModelConfig, num_layers: int, dtype: torch.dtype, fp8_block=None,
                mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every parameter's unsplit (TP 1) shape, by name (built on the meta device: no memory)."""
    with torch.device("meta"):
        modules = make_modules(config, num_layers, dtype, fp8_block, None, mtp)
    return {name: tuple(p.shape) for name, p in iter_params(modules)}


def build_model(config: ModelConfig, num_layers: int, dtype: torch.dtype, device: torch.device | str,
                fp8_block: Optional[tuple[int, int]] = None, tp: Optional[TPGroup] = None, *,
                checkpoint: Optional[Path] = None, seed: int = 0, mtp: Optional[bool] = None,
                kernels: Optional[Kernels] = None,
                placement: Optional[ExpertPlacement] = None) -> tuple[DeepseekForCausalLM, Optional[MTPLayer]]:
    """This rank's (model, MTP layer or None), weights loaded, in eval mode.

    config: the checkpoint's whole config (num_layers <= its num_hidden_layers keeps the first ones);
    fp8_block: the block of weights kept FP8 (None: FP8 checkpoints are dequantised at load);
    tp: this rank's TP group (None: unsplit); checkpoint: the directory, or None for dummy weights
    drawn from `seed`; mtp: build the MTP layer (None: when `has_mtp_layer`); kernels: what the
    modules run (None: `default_kernels`); placement: the routed experts' slots under EP (None: plain)."""
    tp = tp or solo_group()
    want_mtp = has_mtp_layer(config, checkpoint) if mtp is None else mtp
    kernels = kernels or default_kernels(config, dtype, torch.device(device), fp8_block, tp)
    with torch.device(device):
        modules = make_modules(config, num_layers, dtype, fp8_block, tp, want_mtp, kernels, placement)
    model, mtp_layer = modules[""], modules.get("mtp.")
    placed = placed_experts(modules)
    if checkpoint is None:
        shapes = full_shapes(config, num_layers, dtype, fp8_block, want_mtp) if tp.size > 1 else None
        fill_dummy(iter_params(modules), seed, shapes, tp, fp8_block, placed)
        if mtp_layer is not None:
            mtp_layer.embed_tokens, mtp_layer.head = model.embed_tokens, model.lm_head
    else:
        block = (config.fp8.block_n, config.fp8.block_k) if config.fp8 is not None else fp8_block or WEIGHT_BLOCK
        load_checkpoint(modules, Path(checkpoint), config, num_layers, block, tp, placed)
    derive_weights(modules)
    return model, mtp_layer


def default_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    fp8_block: Optional[tuple[int, int]], tp: Optional[TPGroup] = None) -> Kernels:
    """What 'auto' picks for every per-call op of a model built on `device` outside a runner (tp: the
    rank's group, whose layout decides the MoE token exchange)."""
    return auto_kernels(KernelSetup(config, device, dtype, dtype, interpret=interpreting(), fp8_block=fp8_block,
                                    group=tp))


def derive_weights(modules: dict[str, torch.nn.Module]) -> None:
    """After loading: MLA's absorbed w_kc / w_vc and stacked qkv_a_proj, each MLP's stacked gate_up_proj, then
    (with kernels.shared_experts_fused) each MoE's shared experts moved into its routed ones; eval mode."""
    for mod in modules.values():
        for m in list(mod.modules()):
            if hasattr(m, "absorb"):
                m.absorb()
            if hasattr(m, "merge_qkv_a"):
                m.merge_qkv_a()
            if isinstance(m, MLP):
                m.merge_gate_up()
        for m in list(mod.modules()):
            if hasattr(m, "fuse_shared_experts"):
                m.fuse_shared_experts()
        mod.eval()
