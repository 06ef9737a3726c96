"""`--verify-exhaustive`: how close the staged search gets to the exhaustive best, and at what cost.

For each batch size M given:
  1. the staged search (runner.Searcher, the same code `tune` runs) picks a config; its time is
     recorded (compiles are cached on disk, so after a tuning run this is mostly timing);
  2. the exhaustive search times every config of the full grid that fits the device (SGLang's
     grid: BLOCK_SIZE_M 16-256, N 32-256, K 64-256, GROUP_SIZE_M 1-64, 4/8 warps, 2-5 stages;
     no batch-size pruning, no successive halving beyond one round) plus the default config;
  3. the exhaustive top 5, the staged pick and the config in the tuned file for M (if any) are
     timed head to head in interleaved passes on the same inputs; the gap is
     staged_us / best_us - 1 (negative: the staged pick beat the grid, e.g. with a `_DOWN` key).
A row passes when the gap is at most `tolerance` (3%). Results go to
<out-dir>/verify-<config file stem>.json after every batch size.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kernels.tuned_configs import load_configs, nearest_config
from tuning import search_space as ss
from tuning.bench import Bench, Timer, final_ranking
from tuning.runner import Searcher, TuneOptions, _dedupe, _us

TOLERANCE = 0.03


@dataclass
class VerifyRow:
    m: int
    staged: dict
    staged_us: float
    staged_s: float  # seconds the staged search took at this M
    staged_timed: int
    best: dict
    best_us: float
    exhaustive_s: float  # seconds of the exhaustive search at this M (compiles included)
    exhaustive_timed: int
    file_us: Optional[float] = None  # the tuned file's config for M, timed in the same passes

    @property
    def gap(self) -> float:
        return self.staged_us / self.best_us - 1 if self.best_us and math.isfinite(self.best_us) else math.inf

    def to_json(self) -> dict:
        out = asdict(self)
        out["gap"] = self.gap
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


@dataclass
class VerifyReport:
    title: str
    path: Path
    rows: list[VerifyRow] = field(default_factory=list)
    tolerance: float = TOLERANCE
    compile_s: float = 0.0  # exhaustive compiles by the worker pool (shared by all M for fused MoE)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.gap <= self.tolerance for r in self.rows)

    def save(self) -> None:
        data = {"title": self.title, "tolerance": self.tolerance, "ok": self.ok,
                "exhaustive_compile_s": self.compile_s, "rows": [r.to_json() for r in self.rows]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.path)


def report_path(target, opts: TuneOptions) -> Path:
    stem = target.filename(opts.device_name)[: -len(".json")]
    return Path(opts.out_dir) / f"verify-{stem}.json"


def _timed(bench) -> int:
    return sum(1 for t in bench.trials.values() if t.samples or t.error)


def verify_batch(searcher: Searcher, exhaustive: Searcher, m: int, file_cfg: Optional[dict]) -> VerifyRow:
    target, opts = searcher.target, searcher.opts
    problem = searcher._problem()
    default = target.default_config(m)
    t0 = time.perf_counter()
    staged_res = searcher.tune_batch(m, None)
    staged_s = time.perf_counter() - t0
    staged = staged_res.config

    t1 = time.perf_counter()
    exhaustive._problem_cache = problem
    bench = Bench(problem, m, Timer(searcher.device))
    top = exhaustive.search(bench, m, [default])
    # numerically wrong configs cannot be "the best": check the exhaustive finalists too
    top = [c for c in top if not opts.check or bench.check(c) <= problem.tolerance()]
    exhaustive_timed = _timed(bench)
    exhaustive_s = time.perf_counter() - t1

    contenders = _dedupe(top + [staged] + ([file_cfg] if file_cfg else []))
    exhaustive._add_total(len(contenders) * 3)
    ranked = final_ranking(bench, contenders, opts.final_reps, passes=3, on_result=exhaustive._on_result)
    grid_keys = {ss.config_key(c) for c in top}
    best = next((t for t in ranked if ss.config_key(t.cfg) in grid_keys and t.error is None), None)
    best_us = best.us if best else math.inf
    return VerifyRow(m=m, staged=staged, staged_us=bench.trial(staged).us, staged_s=staged_s,
                     staged_timed=staged_res.timed, best=best.cfg if best else {}, best_us=best_us,
                     exhaustive_s=exhaustive_s, exhaustive_timed=exhaustive_timed,
                     file_us=bench.trial(file_cfg).us if file_cfg else None)


def verify(target, opts: TuneOptions, batch_sizes: list[int], device="cuda", console=None,
           precompiler=None) -> VerifyReport:
    """Run the comparison for `batch_sizes`; the report is saved after each one."""
    console = console or Console()
    path = Path(opts.out_dir) / target.filename(opts.device_name)
    tuned = load_configs(path) if path.is_file() else {}
    report = VerifyReport(f"{target.title()}: staged vs exhaustive", report_path(target, opts))
    limits = ss.Limits.for_device(device) if str(device).startswith("cuda") else ss.Limits()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
               TimeElapsedColumn())
    compile0 = precompiler.seconds if precompiler else 0.0
    t0 = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        staged = Searcher(target, opts, device, limits, precompiler, progress)
        exhaustive = Searcher(target, replace(opts, exhaustive=True), device, limits, precompiler, progress)
        for m in batch_sizes:
            if opts.time_limit is not None and time.perf_counter() - t0 > opts.time_limit:
                console.print(f"[yellow]verify: time limit reached before M={m}[/]")
                break
            staged.task = exhaustive.task = progress.add_task(f"verify M={m:<5}", total=0, best="best        -")
            staged.best = exhaustive.best = math.inf
            row = verify_batch(staged, exhaustive, m, nearest_config(tuned, m) if m in tuned else None)
            report.rows.append(row)
            report.compile_s = (precompiler.seconds - compile0) if precompiler else 0.0
            report.save()
            progress.update(staged.task, description=f"verify M={m:<5} done",
                            best=f"gap {100 * row.gap:+.1f}%")
    return report


def verify_layouts(report: VerifyReport) -> list:
    """The staged-vs-exhaustive table: every column, then (narrow terminals) the essential ones."""
    wide, narrow = Table(title=report.title), Table(title=report.title)
    for col in ("M", "staged\ns", "staged\nconfigs", "staged\nus", "file\nus", "exhaustive\ns",
                "exhaustive\nconfigs", "best\nus", "gap"):
        wide.add_column(col, justify="right", no_wrap=True)
    for col in ("M", "staged\nus", "best\nus", "gap"):
        narrow.add_column(col, justify="right", no_wrap=True)
    wide.add_column("staged config / exhaustive best")
    narrow.add_column("staged config / exhaustive best")
    for r in report.rows:
        gap = f"{100 * r.gap:+.1f}%" if math.isfinite(r.gap) else "-"
        configs = f"{ss.describe(r.staged)}\n{ss.describe(r.best) if r.best else '-'}"
        wide.add_row(str(r.m), f"{r.staged_s:.0f}", str(r.staged_timed), _us(r.staged_us), _us(r.file_us),
                     f"{r.exhaustive_s:.0f}", str(r.exhaustive_timed), _us(r.best_us), gap, configs)
        narrow.add_row(str(r.m), _us(r.staged_us), _us(r.best_us), gap, configs)
    return [wide, narrow]


def print_verify(report: VerifyReport, console, n_batch_sizes: int = 18, show=None) -> None:
    """Print the table (`show(console, layouts)` picks a layout; default: the widest) and the verdict."""
    layouts = verify_layouts(report)
    if show is None:
        console.print(layouts[0])
    else:
        show(console, layouts)
    if not report.rows:
        console.print("[yellow]verify: no batch size compared[/]")
        return
    worst = max(r.gap for r in report.rows)
    verdict = "[green]PASS[/]" if report.ok else "[red]FAIL[/]"
    console.print(f"{verdict}: staged pick within {100 * worst:+.1f}% of the exhaustive best "
                  f"(tolerance {100 * report.tolerance:.0f}%) at M = {', '.join(str(r.m) for r in report.rows)}")
    ex = [r.exhaustive_s for r in report.rows]
    st = [r.staged_s for r in report.rows]
    # the first exhaustive M paid the compiles (fused MoE kernels do not depend on M); the others are timing
    later = ex[1:] or ex
    est = ex[0] + (n_batch_sizes - 1) * sum(later) / len(later)
    console.print(f"exhaustive: {sum(ex):.0f} s for {len(ex)} batch size(s) (worker compiles {report.compile_s:.0f} s); "
                  f"extrapolated to SGLang's {n_batch_sizes} batch sizes ~{est:.0f} s. staged: {sum(st):.0f} s for the same "
                  f"{len(st)} (compiles cached from the tuning run when it ran first). wrote {report.path}")
