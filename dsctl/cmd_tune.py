"""`dsctl tune-moe` and `dsctl tune-fp8`: search launch configs for this GPU, write the config files.

The shapes come from the model config and the parallel layout (tuning/shapes.py); each shape
gets one JSON file named as kernels/tuned_configs.py looks it up, written to --out-dir
(default: $DSCTL_KERNEL_CONFIG_DIR if set, else the per-user config directory,
~/.config/dsctl/configs on Linux: both are directories the look-up searches, so the engine
uses the files with no further step; the source tree is never written).
--model defaults to deepseek-v3 (the model operators tune for) and the first line names the
model. Without a CUDA GPU both stop at once, unless --dry-run (shows the plan) or
TRITON_INTERPRET=1 (runs the kernels in Triton's interpreter on CPU: tests only).
--verify-exhaustive compares the staged search with the exhaustive one at a few batch
sizes (tuning/verify.py). The options both commands share are defined once (TuneFlags).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from dsctl.option_sets import option, with_options
from dsctl.tables import print_fitting
from engine.errors import UsageError
from kernels.interpret import interpreting
from tuning.errors import NoGpuError, TuneFailed

_BATCH_HELP = ("Comma-separated batch sizes (tokens per forward), e.g. 1,64,4096 (default: SGLang's 1, 2, 4, 8, 16, "
               "24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096).")
OUT_HELP = ("Where to write the config files (default: $DSCTL_KERNEL_CONFIG_DIR, else the per-user config directory "
             "~/.config/dsctl/configs; both are searched by the engine before the shipped configs).")
_VERIFY_HELP = ("Run the exhaustive search (SGLang's full grid) at these batch sizes and compare it with the "
                "staged search's pick (e.g. 8,256,2048; slow). Alone: only the comparison; with --batch-sizes: "
                "after tuning those.")


def _batch_list(text: Optional[str], flag: str) -> Optional[list[int]]:
    from tuning.shapes import parse_batch_sizes  # lazy: imports torch; keeps dsctl --help fast

    if not text:
        return None
    try:
        return parse_batch_sizes(text)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--batch-sizes", flag)) from None


def _options(batch_sizes, out_dir, resume, exhaustive, max_configs, time_limit, workers, device_name, grid,
             device):
    from tuning import search_space as ss  # lazy: imports torch; keeps dsctl --help fast
    from tuning.runner import TuneOptions  # lazy: imports torch; keeps dsctl --help fast
    from tuning.shapes import parse_batch_sizes  # lazy: imports torch; keeps dsctl --help fast

    if max_configs is not None and max_configs < 1:
        raise UsageError("--max-configs must be >= 1")
    if grid not in ss.GRIDS:
        raise UsageError(f"--grid {grid!r}: choose one of {', '.join(ss.GRIDS)}")
    coarse, full = ss.GRIDS[grid]
    opts = TuneOptions(batch_sizes=parse_batch_sizes(batch_sizes), out_dir=resolve_out_dir(out_dir),
                       device_name=device_name, resume=resume, exhaustive=exhaustive, max_configs=max_configs,
                       time_limit=time_limit, workers=workers, coarse=coarse, full=full)
    if device == "cpu":  # Triton interpreter: timings mean nothing, keep the replays to a minimum
        opts.rounds, opts.final_reps, opts.exhaustive_reps = (1, 1), 3, 1
    return opts


def resolve_out_dir(out_dir: Optional[Path]) -> Path:
    from kernels.tuned_configs import ENV_DIR, per_user_dir  # lazy: imports torch; keeps dsctl --help fast

    if out_dir is not None:
        return out_dir.expanduser()
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else per_user_dir()


def tune_device(dry_run: bool, command: str, dry_run_lists: str) -> tuple[Optional[str], str]:
    """(torch device, device name for file names) of a `dsctl tune-*` command; a one-line error without a GPU
    (unless dry run) that says what `--dry-run` lists instead."""
    import torch  # lazy: imports torch; keeps dsctl --help fast

    from kernels.tuned_configs import device_name  # lazy: imports torch; keeps dsctl --help fast

    if torch.cuda.is_available():
        return "cuda", device_name("cuda")
    if dry_run:
        return None, "{GPU}"
    if interpreting():  # TRITON_INTERPRET=1: runs the kernels on CPU (slow; for tests)
        return "cpu", "cpu"
    raise NoGpuError(f"{command} needs a CUDA GPU; `--dry-run` lists {dry_run_lists}")


def _device(opts: "TuneFlags", command: str) -> tuple[Optional[str], str]:
    return tune_device(opts.dry_run, command, f"the shapes it would tune (model {opts.model}, TP {opts.tp})")


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dsctl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write tuned configs to {out} ({exc.strerror or exc}); pass --out-dir DIR "
                         "and set DSCTL_KERNEL_CONFIG_DIR=DIR when serving") from None


def _one_target(target, opts, device, console, precompiler, verify_sizes) -> None:
    from tuning.runner import print_report, tune  # lazy: imports torch; keeps dsctl --help fast

    console.print(f"[bold]{target.title()}[/]")
    if opts.batch_sizes:
        report = tune(target, opts, device, console, precompiler)
        print_report(report, console, show=print_fitting)
    if verify_sizes:
        from tuning.verify import print_verify, verify  # lazy: imports torch; keeps dsctl --help fast

        vrep = verify(target, opts, verify_sizes, device, console, precompiler)
        print_verify(vrep, console, show=print_fitting)


def _run(targets: list, opts, device: Optional[str], dry_run: bool, verify_sizes: Optional[list[int]]) -> None:
    from kernels.tuned_configs import ENV_DIR, config_dirs  # lazy: imports torch; keeps dsctl --help fast
    from tuning import search_space as ss  # lazy: imports torch; keeps dsctl --help fast
    from tuning.plan import plan, print_plans  # lazy: imports torch; keeps dsctl --help fast
    from tuning.precompile import default_workers  # lazy: imports torch; keeps dsctl --help fast

    console = Console()
    workers = opts.workers or default_workers()
    limits = ss.Limits.for_device(device) if device == "cuda" else ss.Limits()
    if dry_run:
        print_plans([plan(t, opts, limits, workers) for t in targets], opts, workers, console)
        if verify_sizes:
            ex = replace(opts, exhaustive=True, batch_sizes=verify_sizes)
            console.print("[bold]--verify-exhaustive[/] (the full grid at these batch sizes, after the staged search):")
            print_plans([plan(t, ex, limits, workers) for t in targets], ex, workers, console)
        console.print(f"output directory: {opts.out_dir}")
        return
    from tuning.runner import make_precompiler  # lazy: imports torch; keeps dsctl --help fast

    check_writable(opts.out_dir)
    precompiler = None
    failed: list[str] = []
    try:
        try:
            precompiler = make_precompiler(opts, device)
        except Exception as exc:  # noqa: BLE001 - tune() compiles inline instead
            console.print(f"[yellow]compile workers unavailable ({exc}); compiling in this process[/]")
        for target in targets:
            try:
                _one_target(target, opts, device, console, precompiler, verify_sizes)
            except UsageError:
                raise
            except Exception as exc:  # noqa: BLE001 - one shape failing must not lose the others
                line = str(exc).splitlines()[0][:300] if str(exc) else ""
                console.print(f"[red]{target.title()}: failed: {type(exc).__name__}: {line}[/]")
                failed.append(target.title())
    finally:
        if precompiler is not None:
            precompiler.close()
    found = [d.resolve() for d in config_dirs(os.environ.get(ENV_DIR))]
    if opts.out_dir.resolve() in found:
        console.print("the engine picks these files up automatically")
    else:
        console.print(f"to use them, serve with DSCTL_KERNEL_CONFIG_DIR={opts.out_dir} (or --kernel-config-dir)")
    if failed:
        raise TuneFailed(f"{len(failed)} of {len(targets)} shape(s) failed: {'; '.join(failed)}")


def _common(opts: "TuneFlags", device: Optional[str], device_name: str):
    verify_sizes = _batch_list(opts.verify_exhaustive, "--verify-exhaustive")
    topts = _options(opts.batch_sizes, opts.out_dir, opts.resume, opts.exhaustive, opts.max_configs, opts.time_limit,
                     opts.workers, device_name, opts.grid, device)
    topts.report_dir = opts.report_dir
    if verify_sizes and opts.batch_sizes is None:  # --verify-exhaustive alone: only the comparison
        topts.batch_sizes = []
    if verify_sizes and opts.exhaustive:
        raise UsageError("--verify-exhaustive compares the staged search with --exhaustive: use one of them")
    return topts, verify_sizes


RESUME_HELP = "Skip the batch sizes a killed run already finished (read back from its progress / config file)."
_DRY_HELP = "Print shapes, search-space sizes and an estimated time; no GPU needed."
_EXH_HELP = "Time every config of the full grid (slow; the baseline for the fast search)."
_MAXC_HELP = "Cap the configs of each search stage (faster, less thorough)."
_TIME_HELP = "Seconds; start no batch size after this, per shape (finish later with --resume)."
_WORKERS_HELP = "Processes compiling kernels in parallel (default 0: one per CPU core, up to 16)."
_REPORT_HELP = "Also write <config file stem>.results.json (per batch size: default / tuned us, speed-up) here."
_GRID_HELP = "Search space: staged (default) or tiny (a few configs, for tests and interpreter smoke runs)."
DEFAULT_MODEL = "deepseek-v3"
MODEL_HELP = ("Model whose shapes to tune: a registry alias (deepseek-v3, deepseek-r1, ...; see `dsctl models`) "
               "or a checkpoint directory.")
_SEARCH = "Search options"


@dataclass
class TuneFlags:
    """The options tune-moe and tune-fp8 share."""

    model: str = option(DEFAULT_MODEL, MODEL_HELP)
    tp: int = option(8, "Tensor-parallel size the model will be served with.")
    batch_sizes: Optional[str] = option(None, _BATCH_HELP)
    out_dir: Optional[Path] = option(None, OUT_HELP)
    dry_run: bool = option(False, _DRY_HELP)
    resume: bool = option(False, RESUME_HELP, panel=_SEARCH)
    exhaustive: bool = option(False, _EXH_HELP, panel=_SEARCH)
    verify_exhaustive: Optional[str] = option(None, _VERIFY_HELP, panel=_SEARCH)
    max_configs: Optional[int] = option(None, _MAXC_HELP, panel=_SEARCH)
    time_limit: Optional[float] = option(None, _TIME_HELP, panel=_SEARCH)
    workers: int = option(0, _WORKERS_HELP, panel=_SEARCH)
    report_dir: Optional[Path] = option(None, _REPORT_HELP, panel=_SEARCH)
    grid: str = option("staged", _GRID_HELP, hidden=True)


def _announce(command: str, opts: TuneFlags, cfg, extra: str = "") -> None:
    """Say which model (and layout) is tuned: the default is DeepSeek-V3, which a user may not expect."""
    from engine.checkpoint.registry import lookup  # lazy: ~7 ms of dataclasses; keeps dsctl --help fast

    entry = lookup(opts.model)
    name = f"{entry.alias} ({entry.repo_id or 'built in'})" if entry else str(opts.model)
    experts = f", {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}" if cfg.n_routed_experts else ""
    default = "; the default, pass --model to tune another" if opts.model == DEFAULT_MODEL else ""
    Console(highlight=False).print(f"{command}: {escape(name)}: {cfg.num_hidden_layers} layers, hidden "
                                   f"{cfg.hidden_size}{experts}, at TP {opts.tp}{extra}{default}")


@with_options(TuneFlags)
def tune_moe(
    opts: TuneFlags,
    ep: int = typer.Option(1, "--ep", "--ep-size",
                           help="Expert-parallel size (divides --tp; E = experts / ep: the file the engine's "
                                "--ep-size = --tp reads is tuned with --ep equal to --tp)."),
    dtype: Optional[str] = typer.Option(None, "--dtype",
                                        help="Expert weights: fp8_w8a8, bf16 or w4afp8 (INT4 experts, "
                                             "--quantization w4afp8) (default: the checkpoint's)."),
) -> None:
    device, name = _device(opts, "tune-moe")
    from tuning.shapes import load_model_config, moe_shape  # lazy: imports torch; keeps dsctl --help fast
    from tuning.targets import MoETarget  # lazy: imports torch; keeps dsctl --help fast

    cfg = load_model_config(opts.model)
    shape = moe_shape(cfg, tp=opts.tp, ep=ep, dtype=dtype)
    topts, verify_sizes = _common(opts, device, name)
    _announce("tune-moe", opts, cfg, f", EP {ep}" if ep != 1 else "")
    _run([MoETarget(shape)], topts, device, opts.dry_run, verify_sizes)


def _parse_shapes(text: Optional[str]) -> Optional[list[tuple[int, int]]]:
    if not text:
        return None
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            n, k = part.lower().split("x")
            out.append((int(n), int(k)))
        except ValueError:
            raise UsageError(f"--shapes {text!r}: expected NxK pairs such as 1536x7168,7168x2048") from None
    return out


def _select_shapes(shapes: list, wanted: Optional[list[tuple[int, int]]], max_shapes: Optional[int]) -> list:
    if wanted:
        by_nk = {(s.N, s.K): s for s in shapes}
        missing = [f"{n}x{k}" for n, k in wanted if (n, k) not in by_nk]
        if missing:
            known = ", ".join(f"{s.N}x{s.K}" for s in shapes)
            raise UsageError(f"--shapes {','.join(missing)}: not a GEMM of this model at this TP (it has: {known})")
        shapes = [by_nk[nk] for nk in dict.fromkeys(wanted)]
    if max_shapes is not None:
        if max_shapes < 1:
            raise UsageError("--max-shapes must be >= 1")
        shapes = shapes[:max_shapes]
    return shapes


@with_options(TuneFlags)
def tune_fp8(
    opts: TuneFlags,
    layers: Optional[str] = typer.Option(None, "--layers", help="Only the GEMMs of these layers (comma-separated "
                                         "name parts, e.g. q_a,o_proj)."),
    shapes_opt: Optional[str] = typer.Option(None, "--shapes", help="Only these GEMMs, as NxK pairs "
                                             "(e.g. 1536x7168,7168x2048)."),
    max_shapes: Optional[int] = typer.Option(None, "--max-shapes",
                                             help="Only the first N GEMM shapes (in --dry-run order)."),
) -> None:
    device, name = _device(opts, "tune-fp8")
    from tuning.shapes import gemm_shapes, load_model_config  # lazy: imports torch; keeps dsctl --help fast
    from tuning.targets import GemmTarget  # lazy: imports torch; keeps dsctl --help fast

    cfg = load_model_config(opts.model)
    names = [s for s in (layers or "").split(",") if s.strip()] or None
    shapes = _select_shapes(gemm_shapes(cfg, tp=opts.tp, layers=names), _parse_shapes(shapes_opt), max_shapes)
    topts, verify_sizes = _common(opts, device, name)
    _announce("tune-fp8", opts, cfg, f", {len(shapes)} GEMM shape(s)")
    _run([GemmTarget(s) for s in shapes], topts, device, opts.dry_run, verify_sizes)


def register(app: typer.Typer) -> None:
    app.command("tune-moe", help="Tune the fused-MoE kernel's launch configs for this GPU (one file per "
                "model shape, picked up automatically).")(tune_moe)
    app.command("tune-fp8", help="Tune the block-FP8 GEMM launch configs for every FP8 linear-layer shape of "
                "the model at this TP (picked up automatically).")(tune_fp8)
