"""Which layouts of each registry model fit the usual machines (`dsctl models --fit`, docs/memory_plan.md).

For every distinct shipped config (aliases sharing one are listed together), every weight scheme that applies
(its own FP8 or bf16, `--quantization fp8` for a bf16 checkpoint, `w4afp8` where the CLI offers it) and every
layout over a machine's GPUs (TP, TP + DP attention, TP + EP), the memory plan's verdict at the default flags
(bf16 KV cache, the model's full context allowed, --mem-fraction-static 0.85): the KV tokens per DP group,
or why not.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import MODELS
from engine.distributed.divisibility import check_model_divisible
from engine.errors import UsageError
from engine.memory.formats import FP8_BLOCK, quantization_for
from engine.memory.plan import GB, PlanSpec, plan_memory
from engine.memory.plan_check import judge, offered_quantizations

# (label, GPUs, one card's total memory as CUDA reports it)
MACHINES = (("8 x H100 80GB", 8, 85.0 * GB), ("8 x H200 141GB", 8, 150.0 * GB), ("4 x H200 141GB", 4, 150.0 * GB))


@dataclass(frozen=True)
class FitRow:
    models: str  # aliases sharing the config
    quant: str
    layout: str  # "TP", "TP + DP attention", "TP + EP"
    cells: tuple[str, ...]  # one per machine


def _schemes(cfg) -> list[str]:
    offered = offered_quantizations()
    out = ["fp8"] if cfg.fp8 is not None else ["bf16"] + (["fp8"] if "fp8" in offered else [])
    if cfg.n_routed_experts and "w4afp8" in offered:
        out.append("w4afp8")
    return out


def _cell(spec: PlanSpec) -> str:
    try:
        check_model_divisible(spec.cfg, spec.tp, spec.quant.fp8_block, ep_size=spec.ep, attn_tp_size=spec.attn_tp)
    except UsageError:
        return "n/a (split)"
    plan = plan_memory(spec)
    v = judge(plan)
    if not v.fits:
        return f"no ({plan.weight_bytes / GB:.0f} GB wts)"
    tokens = f"{v.pool / 1000:,.0f}k" if v.pool >= 10_000 else f"{v.pool:,}"
    return tokens + (f" x {spec.dp}" if spec.dp > 1 else "")


def fit_rows() -> list[FitRow]:
    by_config: dict[str, list[str]] = {}
    for entry in MODELS.values():
        if not entry.builtin:
            by_config.setdefault(entry.config_name, []).append(entry.alias)
    rows = []
    for aliases in by_config.values():
        cfg = parse_config(next(MODELS[a] for a in aliases).config_dict())
        block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else None
        for scheme in _schemes(cfg):
            # --quantization fp8 makes a bf16 checkpoint 128 x 128 block-FP8; w4afp8 keeps the linears as shipped
            quant = quantization_for(scheme, block or FP8_BLOCK.scale_block if scheme == "fp8" else block)
            for layout in ("TP", "TP + DP attention", "TP + EP"):
                cells = []
                for _, gpus, gpu_bytes in MACHINES:
                    spec = PlanSpec(cfg, aliases[0], tp=gpus, dp=gpus if "DP" in layout else 1,
                                    ep=gpus if "EP" in layout else 1, quant=quant, gpu_bytes=gpu_bytes,
                                    mtp=bool(cfg.num_nextn_predict_layers))
                    cells.append(_cell(spec))
                rows.append(FitRow(", ".join(aliases), scheme, layout, tuple(cells)))
    return rows
