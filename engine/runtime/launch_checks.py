"""The checks every launcher runs before any weight is read, and the flags the ranks start with.

`launch_args(args)`: `--enable-dp-attention` alone spans the visible GPUs. `check_launch(args,
resolved)`: the parallel flags against this machine (ranks vs visible GPUs), the TP size against
the model (heads, intermediate sizes, FP8 blocks) and, on CUDA, the memory plan's verdict
(engine/memory/plan.py, plan_check.py: refused with the reason and the fixes that would work).
`plan_spec` turns flags into the plan's input; `dry_run_plan` is `dsctl serve --dry-run`'s plan.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from engine.args import EngineArgs
from engine.checkpoint.resolve import ResolvedModel, resolve_model
from engine.distributed.divisibility import check_model_divisible
from engine.distributed.expert_placement import placement_for
from engine.distributed.parallel_config import ParallelConfig
from engine.errors import CheckpointError, UsageError
from engine.memory.plan import GB, MemoryPlan, PlanSpec, plan_memory, spec_from_args, used_by_others
from engine.memory.plan_check import Verdict, judge
from engine.runner.device import pick_device
from engine.speculative.launch_check import check_spec_launch
from engine.weights.loader import has_mtp_layer
from engine.weights.w4afp8 import check_int4_split

log = logging.getLogger(__name__)


def fp8_kept(args: EngineArgs, resolved: ResolvedModel, device_type: str) -> Optional[tuple[int, int]]:
    """The FP8 block the weights keep on this device (None when they are dequantised, as on CPU)."""
    cfg, q = resolved.config, args.model.quantization
    if device_type != "cuda" or q == "none":
        return None
    if cfg.fp8 is not None:
        return (cfg.fp8.block_n, cfg.fp8.block_k)
    return (128, 128) if q == "fp8" else None


def _visible_gpus(device_type: str) -> Optional[int]:
    return torch.cuda.device_count() if device_type == "cuda" else None


def check_launch(args: EngineArgs, resolved: Optional[ResolvedModel] = None) -> ResolvedModel:
    """Reject, before any weight is read, a parallel layout this machine or this model cannot run."""
    args.validate()
    resolved = resolved or resolve_model(args.model)
    device = pick_device(args.model.device)
    gpus = _visible_gpus(device.type)
    pc = dp_attention_span(args, device.type, gpus, say_one_rank=True).parallel.config()
    pc.validate(device.type, gpus)
    if pc.dp_size > 1 or pc.ep_size > 1:
        log.info("layout: --tp %d, %d DP attention group(s) of %d rank(s), experts %s", pc.tp_size, pc.dp_size,
                 pc.attn_tp_size, f"split whole over {pc.ep_size} EP ranks" if pc.ep_size > 1 else "TP-split")
    cfg = resolved.config
    if args.model.num_layers:
        cfg = cfg.with_num_layers(args.model.num_layers)
    block = fp8_kept(args, resolved, device.type)
    check_spec_launch(args, resolved)
    if pc.tp_size > 1:
        check_model_divisible(cfg, pc.tp_size, block, ep_size=pc.ep_size, attn_tp_size=pc.attn_tp_size)
    check_int4_split(cfg, args.model.quantization, pc.tp_size, pc.ep_size)  # W4AFP8 experts (INT4 groups)
    if args.parallel.expert_placement:
        placement_for(args.parallel.expert_placement, resolved.config, pc.ep_size)
    if device.type == "cuda":  # the card's total only: asking CUDA for free memory would hold a context here
        spec = plan_spec(args, resolved, pc, torch.cuda.get_device_properties(pc.gpu_id(0)).total_memory,
                         gpus_per_node=gpus or 1)
        verdict = judge(plan_memory(spec))
        if not verdict.fits:
            raise UsageError(verdict.reason)
    return resolved


def dp_attention_span(args: EngineArgs, device_type: str, gpus: Optional[int], say_one_rank: bool) -> EngineArgs:
    """`--enable-dp-attention` with no --tp / --dp spans every visible GPU (--tp = GPU count, and --dp follows
    --tp: `ParallelArgs.config`), as SGLang's does; on one GPU or on CPU that is one rank, which is plain
    attention (said by `check_launch`, `say_one_rank`: `launch_args` runs before it on the same flags, and the
    spanning it says cannot happen twice, as the spanned flags have a --tp)."""
    p = args.parallel
    if not p.enable_dp_attention or p.tp_size != 1 or p.dp_size != 1:
        return args
    if (gpus or 1) > 1:
        spanning = args.replace(tp_size=gpus)
        log.warning("--enable-dp-attention with no --tp: spanning the %d visible GPUs (--tp %d --dp %d)",
                    gpus, gpus, spanning.parallel.config().dp_size)
        return spanning
    if say_one_rank:
        log.warning("--enable-dp-attention on %s: one rank, so DP attention is the same as plain attention",
                    "one GPU" if device_type == "cuda" else "CPU")
    return args


def plan_spec(args: EngineArgs, resolved: ResolvedModel, pc: ParallelConfig, gpu_bytes: float,
              gpu_used_bytes: float = 0.0, gpus_per_node: int = 8) -> PlanSpec:
    """The memory plan's input for these flags on a GPU of `gpu_bytes` (`gpu_used_bytes` already in use)."""
    cfg = resolved.config.with_num_layers(args.model.num_layers) if args.model.num_layers else resolved.config
    return spec_from_args(args, cfg, tp=pc.tp_size, dp=pc.dp_size if pc.enable_dp_attention else 1,
                          ep=pc.ep_size, fp8_block=fp8_kept(args, resolved, "cuda"),
                          mtp=has_mtp_layer(resolved.config, None if resolved.dummy else resolved.path),
                          gpu_bytes=gpu_bytes, gpu_used_bytes=gpu_used_bytes,
                          gpus_per_node=max(gpus_per_node, pc.ranks_per_node))


def _dry_run_model(args: EngineArgs) -> ResolvedModel:
    """The model to plan for: the checkpoint when it is here, else (a registry alias) its shipped config."""
    try:
        return resolve_model(args.model)
    except CheckpointError:
        return resolve_model(dataclasses.replace(args.model, load_format="dummy"))


def dry_run_plan(args: EngineArgs) -> tuple[MemoryPlan, Verdict]:
    """`dsctl serve --dry-run`: the plan and its verdict for --gpu-memory-gb, else this machine's first GPU and its
    free memory; reads no weight. UsageError when the layout is wrong for the model or no card is known."""
    args = launch_args(args.validate())  # --enable-dp-attention alone spans this machine's GPUs
    resolved = _dry_run_model(args)
    pc = args.parallel.config()
    cfg = resolved.config.with_num_layers(args.model.num_layers) if args.model.num_layers else resolved.config
    if pc.tp_size > 1:
        block = fp8_kept(args, resolved, "cuda")
        check_model_divisible(cfg, pc.tp_size, block, ep_size=pc.ep_size, attn_tp_size=pc.attn_tp_size)
    if args.cache.gpu_memory_gb is not None:
        total, used = args.cache.gpu_memory_gb * GB, 0.0
    elif torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(pc.gpu_id(0))
        used = used_by_others(total, free)
    else:
        raise UsageError("--dry-run on a machine without a CUDA GPU needs --gpu-memory-gb N, the card to plan for "
                         "(85 for an H100 80GB, 150 for an H200 141GB)")
    spec = plan_spec(args, resolved, pc, total, used)
    plan = plan_memory(spec)
    return plan, judge(plan)


def launch_args(args: EngineArgs) -> EngineArgs:
    """The flags the ranks start with: `--enable-dp-attention` alone becomes --tp = --dp = visible GPUs."""
    device = pick_device(args.model.device)
    return dp_attention_span(args, device.type, _visible_gpus(device.type), say_one_rank=False)
