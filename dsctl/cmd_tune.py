"""`dsctl tune-moe` and `dsctl tune-fp8`: search launch configs for this GPU, write the config files.

The shapes come from the model config and the parallel layout (tuning/shapes.py); each shape
gets one JSON file named as kernels/tuned_configs.py looks it up, written to --out-dir
(default: $DSCTL_KERNEL_CONFIG_DIR if set, else the package's kernels/configs/), so the engine
uses it with no further step. --dry-run shows the plan without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from engine.errors import UsageError

_MODEL_HELP = "Model alias (deepseek-v3, deepseek-r1, ...; see `dsctl models`) or a checkpoint directory."
_BATCH_HELP = "Comma-separated batch sizes (tokens per forward) [default: 1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096]."
_OUT_HELP = "Where to write the config files [default: $DSCTL_KERNEL_CONFIG_DIR, else the shipped kernels/configs/]."


def _options(batch_sizes, out_dir, resume, exhaustive, max_configs, time_limit, workers, device_name):
    from tuning.runner import TuneOptions
    from tuning.shapes import parse_batch_sizes

    if max_configs is not None and max_configs < 1:
        raise UsageError("--max-configs must be >= 1")
    return TuneOptions(batch_sizes=parse_batch_sizes(batch_sizes), out_dir=_out_dir(out_dir), device_name=device_name,
                       resume=resume, exhaustive=exhaustive, max_configs=max_configs, time_limit=time_limit,
                       workers=workers)


def _out_dir(out_dir: Optional[Path]) -> Path:
    from kernels.tuned_configs import ENV_DIR, SHIPPED_DIR

    if out_dir is not None:
        return out_dir.expanduser()
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else SHIPPED_DIR


def _device(dry_run: bool) -> tuple[Optional[str], str]:
    """(torch device, device name for file names); a one-line error without a GPU (unless dry run)."""
    import torch

    from kernels.fp8 import interpreting
    from kernels.tuned_configs import device_name

    if torch.cuda.is_available():
        return "cuda", device_name("cuda")
    if interpreting():  # TRITON_INTERPRET=1: runs the kernels on CPU (slow; for tests)
        return "cpu", "cpu"
    if dry_run:
        return None, "{GPU}"
    raise UsageError("no CUDA GPU found: tuning times the kernels on the GPU it tunes for, so run it on that "
                     "machine (or add --dry-run to see the shapes and the search plan)")


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dsctl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write tuned configs to {out} ({exc.strerror or exc}); pass --out-dir DIR "
                         "and set DSCTL_KERNEL_CONFIG_DIR=DIR when serving") from None


def _run(targets: list, opts, device: Optional[str], dry_run: bool) -> None:
    from rich.console import Console

    from kernels.tuned_configs import config_dirs
    from tuning import search_space as ss
    from tuning.plan import plan, print_plans
    from tuning.precompile import default_workers

    console = Console()
    workers = opts.workers or default_workers()
    limits = ss.Limits.for_device(device) if device == "cuda" else ss.Limits()
    if dry_run:
        print_plans([plan(t, opts, limits, workers) for t in targets], opts, workers, console)
        console.print(f"output directory: {opts.out_dir}")
        return
    from tuning.runner import make_precompiler, print_report, tune

    _check_writable(opts.out_dir)
    precompiler = None
    try:
        try:
            precompiler = make_precompiler(opts, device)
        except Exception as exc:  # noqa: BLE001 - tune() compiles inline instead
            console.print(f"[yellow]compile workers unavailable ({exc}); compiling in this process[/]")
        for target in targets:
            console.print(f"[bold]{target.title()}[/]")
            report = tune(target, opts, device, console, precompiler)
            print_report(report, console)
    finally:
        if precompiler is not None:
            precompiler.close()
    found = [d.resolve() for d in config_dirs()]
    if opts.out_dir.resolve() in found:
        console.print("the engine picks these files up automatically")
    else:
        console.print(f"to use them, serve with DSCTL_KERNEL_CONFIG_DIR={opts.out_dir}")


def tune_moe(
    model: str = typer.Option(..., "--model", help=_MODEL_HELP),
    tp: int = typer.Option(8, "--tp", help="Tensor-parallel size the model will be served with."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel size (divides --tp; E = experts / ep)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Expert weights: fp8_w8a8 or bf16 [default: the checkpoint's]."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help=_BATCH_HELP),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help=_OUT_HELP),
    resume: bool = typer.Option(False, "--resume", help="Skip the batch sizes a killed run already finished."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print shapes, search-space sizes and an estimated time; no GPU needed."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Time every config of the full grid (slow; the baseline for the fast search)."),
    max_configs: Optional[int] = typer.Option(None, "--max-configs", help="Cap the configs of each search stage (faster, less thorough)."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", help="Seconds; start no batch size after this (finish later with --resume)."),
    workers: int = typer.Option(0, "--workers", help="Processes compiling kernels in parallel [default: one per CPU core, up to 16]."),
) -> None:
    from tuning.shapes import load_model_config, moe_shape
    from tuning.targets import MoETarget

    shape = moe_shape(load_model_config(model), tp=tp, ep=ep, dtype=dtype)
    device, name = _device(dry_run)
    opts = _options(batch_sizes, out_dir, resume, exhaustive, max_configs, time_limit, workers, name)
    _run([MoETarget(shape)], opts, device, dry_run)


def tune_fp8(
    model: str = typer.Option(..., "--model", help=_MODEL_HELP),
    tp: int = typer.Option(8, "--tp", help="Tensor-parallel size the model will be served with."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Only the GEMMs of these layers (comma-separated name parts, e.g. q_a,o_proj)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help=_BATCH_HELP),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help=_OUT_HELP),
    resume: bool = typer.Option(False, "--resume", help="Skip the batch sizes a killed run already finished."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print shapes, search-space sizes and an estimated time; no GPU needed."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Time every config of the full grid (slow; the baseline for the fast search)."),
    max_configs: Optional[int] = typer.Option(None, "--max-configs", help="Cap the configs of each search stage (faster, less thorough)."),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", help="Seconds; start no batch size after this (finish later with --resume)."),
    workers: int = typer.Option(0, "--workers", help="Processes compiling kernels in parallel [default: one per CPU core, up to 16]."),
) -> None:
    from tuning.shapes import gemm_shapes, load_model_config
    from tuning.targets import GemmTarget

    names = [s for s in (layers or "").split(",") if s.strip()] or None
    shapes = gemm_shapes(load_model_config(model), tp=tp, layers=names)
    device, name = _device(dry_run)
    opts = _options(batch_sizes, out_dir, resume, exhaustive, max_configs, time_limit, workers, name)
    _run([GemmTarget(s) for s in shapes], opts, device, dry_run)


def register(app: typer.Typer) -> None:
    app.command("tune-moe", help="Tune the fused-MoE kernel's launch configs for this GPU (one file per "
                "model shape, picked up automatically).")(tune_moe)
    app.command("tune-fp8", help="Tune the block-FP8 GEMM launch configs for every FP8 linear-layer shape of "
                "the model at this TP (picked up automatically).")(tune_fp8)
