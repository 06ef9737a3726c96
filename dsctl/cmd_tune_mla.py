"""`dsctl tune-mla`: tune the MLA decode kernel for this GPU and write the per-batch-size table the engine reads.

The table (kernels/tuned_configs.py, `MLA_DECODE,H=..,kv_dtype=..,device_name=...json`) holds, per batch size,
the Triton kernel's launch parameters and, where FlashInfer is installed, whether its MLA decode was faster
(the flashinfer-decode backend then decodes those batch sizes with FlashInfer and the others with Triton). The
heads per rank come from the model and the layout: --tp ranks in --dp attention groups (DP attention: --dp
equal to --tp, every rank attends with all heads). Without a CUDA GPU the command stops at once, unless
--dry-run or TRITON_INTERPRET=1 (the Triton interpreter on CPU: tests only). The search itself is
tuning/mla_decode.py.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dsctl.cmd_tune import (
    DEFAULT_MODEL,
    MODEL_HELP,
    OUT_HELP,
    RESUME_HELP,
    check_writable,
    resolve_out_dir,
    tune_device,
)
from dsctl.tables import print_fitting

_BATCH_HELP = "Comma-separated decode batch sizes (requests per step) (default: 1, 2, 4, ..., 256)."
_CTX_HELP = "Comma-separated context lengths each candidate is timed at; its score is their geometric mean."
_KV_HELP = "KV-cache dtypes to tune, comma-separated: bf16, fp16, fp8_e4m3 (one table each)."


def _flashinfer_installed(device: Optional[str]) -> bool:
    return device == "cuda" and importlib.util.find_spec("flashinfer") is not None


def _report(results: list, shape, console: Console) -> None:
    def table(with_config: bool) -> Table:
        t = Table(title=shape.title(), title_justify="left")
        for col in ["batch", "tuned us", "default us", "speed-up", "FlashInfer us", *(["config"] if with_config
                                                                                      else [])]:
            t.add_column(col, justify="left" if col == "config" else "right", no_wrap=col != "config")
        for r in results:
            c = r.config
            fi = f"{r.flashinfer_us:.1f}{' (faster)' if r.flashinfer_faster else ''}" if r.flashinfer_us else "-"
            default_ok = math.isfinite(r.default_us)  # inf: the default failed its check or did not run
            cells = [str(r.batch), f"{r.tuned_us:.1f}", f"{r.default_us:.1f}" if default_ok else "skipped",
                     f"{r.default_us / r.tuned_us:.2f}x" if default_ok else "-", fi]
            if with_config:
                cells.append(f"h{c.block_h} n{c.block_n} w{c.num_warps} s{c.num_stages} {c.kv_load}"
                             f"{' fp16' if c.fp16_math else ''} split {c.programs_per_sm:g}/SM >={c.min_split_tokens}")
            t.add_row(*cells)
        return t
    print_fitting(console, [table(True), table(False)])


def tune_mla(
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=MODEL_HELP),
    tp: int = typer.Option(8, "--tp", help="Tensor-parallel size the model will be served with."),
    dp: int = typer.Option(1, "--dp", help="Attention data-parallel groups (--enable-dp-attention's --dp; divides "
                                           "--tp): each rank attends with heads x dp / tp heads."),
    kv_cache_dtype: str = typer.Option("bf16,fp8_e4m3", "--kv-cache-dtype", help=_KV_HELP),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help=_BATCH_HELP),
    contexts: Optional[str] = typer.Option(None, "--contexts", help=_CTX_HELP),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help=OUT_HELP),
    resume: bool = typer.Option(False, "--resume", help=RESUME_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the tables it would write; no GPU needed."),
    no_flashinfer: bool = typer.Option(False, "--no-flashinfer", help="Do not time FlashInfer's MLA decode even "
                                       "where it is installed (the table then leaves the choice to the engine)."),
) -> None:
    device, name = tune_device(dry_run, "tune-mla", "the tables it would write")
    import torch  # lazy: keeps dsctl --help fast

    from tuning import mla_decode as tm  # lazy: imports torch
    from tuning.shapes import load_model_config, parse_batch_sizes  # lazy: imports torch

    cfg = load_model_config(model)
    shapes = [tm.mla_shape(cfg, tp, dp, kv.strip()) for kv in kv_cache_dtype.split(",") if kv.strip()]
    batches = parse_batch_sizes(batch_sizes, tm.DEFAULT_BATCH_SIZES)
    ctxs = tuple(parse_batch_sizes(contexts, tm.DEFAULT_CONTEXTS, "--contexts", "context lengths"))
    out = resolve_out_dir(out_dir)
    console = Console(highlight=False)
    console.print(f"tune-mla: {model}, TP {tp}, DP {dp}: {shapes[0].heads} heads per rank; batch sizes "
                  f"{','.join(map(str, batches))}; contexts {','.join(map(str, ctxs))}")
    if dry_run:
        for s in shapes:
            console.print(f"{s.title()}: {len(tm.tile_candidates(s))} tile candidates + {len(tm.SPLIT_SETTINGS)} split "
                          f"settings per batch size -> {out / s.filename(name)}")
        return
    check_writable(out)
    flashinfer = not no_flashinfer and _flashinfer_installed(device)
    for s in shapes:
        console.print(f"[bold]{s.title()}[/]")
        tuner = tm.MlaTuner(s, torch.device(device), ctxs, flashinfer=flashinfer, log=console.print)
        results = tm.tune_mla(tuner, batches, out / s.filename(name), resume=resume)
        if results:
            _report(results, s, console)
        console.print(f"wrote {out / s.filename(name)}")


def register(app: typer.Typer) -> None:
    app.command("tune-mla", help="Tune the MLA decode kernel's launch parameters per batch size for this GPU (and "
                "where FlashInfer is installed, which of the two decodes each batch size); picked up automatically.")(
        tune_mla)
