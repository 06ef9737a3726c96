"""The checks every launcher runs before any weight is read, and the flags the ranks start with.

`launch_args(args)`: `--enable-dp-attention` alone spans the visible GPUs. `check_launch(args,
resolved)`: the parallel flags against this machine (ranks vs visible GPUs), the TP size against
the model (heads, intermediate sizes, FP8 blocks) and, on CUDA, whether the weights and some KV
fit (with the bytes needed and flags that would fit).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from engine.args import EngineArgs
from engine.checkpoint.resolve import ResolvedModel, resolve_model
from engine.distributed.divisibility import check_model_divisible
from engine.distributed.sizing import Layout, check_fits
from engine.runner.device import pick_device
from engine.speculative.launch_check import check_spec_launch

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
    pc = dp_attention_span(args, device.type, gpus).parallel.config()
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
    if device.type == "cuda":
        _check_fits(args, cfg, block, pc, torch.cuda.get_device_properties(pc.gpu_id(0)).total_memory)
    return resolved


def dp_attention_span(args: EngineArgs, device_type: str, gpus: Optional[int]) -> EngineArgs:
    """`--enable-dp-attention` with no --tp / --dp spans every visible GPU (--tp = GPU count, and --dp follows
    --tp: `ParallelArgs.config`), as SGLang's does; on one GPU or on CPU that is one rank, which is plain
    attention (said at start-up)."""
    p = args.parallel
    if not p.enable_dp_attention or p.tp_size != 1 or p.dp_size != 1:
        return args
    if (gpus or 1) > 1:
        spanning = args.replace(tp_size=gpus)
        log.warning("--enable-dp-attention with no --tp: spanning the %d visible GPUs (--tp %d --dp %d)",
                    gpus, gpus, spanning.parallel.config().dp_size)
        return spanning
    log.warning("--enable-dp-attention on %s: one rank, so DP attention is the same as plain attention",
                "one GPU" if device_type == "cuda" else "CPU")
    return args


def _check_fits(args: EngineArgs, cfg, block, pc, gpu_bytes: int) -> None:
    kv_bytes = 1 if args.cache.kv_cache_dtype != "auto" else 2
    dtype_bytes = 4 if args.model.dtype == "float32" else 2
    layout = Layout(pc.tp_size, gpu_bytes, args.cache.mem_fraction_static, dtype_bytes, block, kv_bytes,
                    include_mtp=bool(cfg.num_nextn_predict_layers), gpus_per_node=max(1, pc.ranks_per_node),
                    attn_tp_size=pc.attn_tp_size, ep_size=pc.ep_size)
    check_fits(cfg, layout, min_kv_tokens=1024, name=args.model.model)


def launch_args(args: EngineArgs) -> EngineArgs:
    """The flags the ranks start with: `--enable-dp-attention` alone becomes --tp = --dp = visible GPUs."""
    device = pick_device(args.model.device)
    return dp_attention_span(args, device.type, _visible_gpus(device.type))
