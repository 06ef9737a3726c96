"""Tune one target (fused-MoE or GEMM shape) over a list of batch sizes.

Per batch size M (staged search, each stage ranked by successive halving, bench.py):
  1. the coarse grid (tile shape, warps, pipeline depth 3-4), pruned for M (search_space.py),
     plus the built-in default config and the installed config for M (if a file exists);
  2. neighbours of the 3 best in GROUP_SIZE_M, num_stages and num_warps (full grid values);
  3. fused MoE only: the down-projection GEMM's keys one at a time (`<KEY>_DOWN`), and the
     combination of every improving change;
  then the finalists, the default and the installed config are timed together in interleaved
  passes, and the fastest one whose output matches the torch reference is kept.
With `exhaustive`, every config of the full grid that fits the device is timed instead
(no batch-size pruning, no stages) and the finalists are timed as above: the baseline for
checking the staged search.

After each batch size the config file (named as kernels/tuned_configs.py names it) and a
progress file beside it are rewritten, so `resume` skips the batch sizes already done. The
progress file is removed once every batch size is done.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.errors import UsageError
from kernels.interpret import interpreting
from kernels.tuned_configs import ENV_DIR, clear_config_cache, config_dirs, load_configs, nearest_config, save_configs
from tuning import search_space as ss
from tuning.bench import Bench, Timer, final_ranking, successive_halving
from tuning.precompile import Precompiler, default_workers

STATE_VERSION = 1


@dataclass
class TuneOptions:
    batch_sizes: list[int]
    out_dir: Path
    device_name: str
    resume: bool = False
    exhaustive: bool = False
    max_configs: Optional[int] = None  # cap on the configs of each search stage
    time_limit: Optional[float] = None  # seconds: no batch size starts after this
    workers: int = 0  # compile processes (GPU): 0 = one per CPU core, up to 16; 1 = compile inline
    seed: int = 0
    rounds: tuple = (2, 6, 20)  # graph replays per successive-halving round
    eta: int = 3  # keep the best 1/eta after each round
    keep: int = 3  # ... and at least this many
    top: int = 3  # configs whose neighbourhood stage 2 searches
    final_reps: int = 30
    exhaustive_reps: int = 5
    coarse: ss.Grid = ss.COARSE
    full: ss.Grid = ss.FULL
    check: bool = True
    report_dir: Optional[Path] = None  # also write <config stem>.results.json here (timings, speed-ups)


@dataclass
class BatchResult:
    m: int
    config: dict
    tuned_us: Optional[float] = None
    default_us: Optional[float] = None
    existing_us: Optional[float] = None  # the config installed before this run, if any
    timed: int = 0  # distinct configs timed
    seconds: float = 0.0
    error: Optional[float] = None  # relative error of the kept config vs the torch reference
    note: str = ""

    @property
    def speedup(self) -> Optional[float]:
        if self.tuned_us and self.default_us and math.isfinite(self.default_us):
            return self.default_us / self.tuned_us
        return None

    def to_json(self) -> dict:
        out = asdict(self)
        for k in ("tuned_us", "default_us", "existing_us", "error"):
            if out[k] is not None and not math.isfinite(out[k]):
                out[k] = None
        return out

    @classmethod
    def from_json(cls, data: dict) -> "BatchResult":
        data = dict(data)
        data["config"] = {k: int(v) for k, v in data["config"].items()}
        return cls(**data)


@dataclass
class TuneReport:
    title: str
    path: Path
    results: dict[int, BatchResult]
    requested: list[int]
    seconds: float = 0.0
    skipped: list[int] = field(default_factory=list)  # not reached within the time limit
    compile_seconds: float = 0.0
    kernels_built: int = 0


# --------------------------------------------------------------------------- files


def _state_path(out: Path) -> Path:
    return out.with_name(out.name[: -len(".json")] + ".progress.json")


def _meta(target, opts: TuneOptions) -> dict:
    # through JSON and back, so tuples compare equal to the lists a saved file holds
    return json.loads(json.dumps({**target.meta(), "device": opts.device_name, "exhaustive": opts.exhaustive}))


def load_done(target, opts: TuneOptions, out: Path) -> dict[int, BatchResult]:
    """Batch sizes already tuned (resume): the progress file, else the config file itself."""
    if not opts.resume:
        return {}
    state = _state_path(out)
    if state.is_file():
        data = json.loads(state.read_text())
        if data.get("version") != STATE_VERSION or data.get("meta") != _meta(target, opts):
            raise UsageError(f"{state} was written for another shape, device or mode; "
                             "delete it or run without --resume")
        return {int(m): BatchResult.from_json(r) for m, r in data["results"].items()}
    if out.is_file():
        return {m: BatchResult(m, cfg, note="from file") for m, cfg in load_configs(out).items()}
    return {}


def save(target, opts: TuneOptions, out: Path, results: dict[int, BatchResult], complete: bool) -> None:
    save_configs(out, {m: r.config for m, r in results.items()})
    state = _state_path(out)
    if complete:
        state.unlink(missing_ok=True)
    else:
        data = {"version": STATE_VERSION, "meta": _meta(target, opts),
                "results": {str(m): results[m].to_json() for m in sorted(results)}}
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(state)
    clear_config_cache()


def save_results(report: "TuneReport", opts: TuneOptions) -> None:
    """Machine-readable per-batch-size results (for scripts; not read by the engine)."""
    if opts.report_dir is None:
        return
    d = Path(opts.report_dir)
    d.mkdir(parents=True, exist_ok=True)
    data = {"title": report.title, "config_file": str(report.path), "seconds": report.seconds,
            "compile_seconds": report.compile_seconds, "kernels_built": report.kernels_built,
            "skipped": report.skipped, "results": [
                {**report.results[m].to_json(), "speedup": report.results[m].speedup} for m in sorted(report.results)]}
    out = d / (report.path.name[: -len(".json")] + ".results.json")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)


def installed_configs(target, opts: TuneOptions) -> tuple[Optional[Path], dict[int, dict]]:
    """The config file the engine would use now (out dir, then DSCTL_KERNEL_CONFIG_DIR, then shipped)."""
    name = target.filename(opts.device_name)
    for d in [opts.out_dir, *config_dirs(os.environ.get(ENV_DIR))]:
        if (Path(d) / name).is_file():
            try:
                return Path(d) / name, load_configs(Path(d) / name)
            except (ValueError, KeyError, OSError):
                return None, {}
    return None, {}


# --------------------------------------------------------------------------- search


def _dedupe(cfgs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in cfgs:
        k = ss.config_key(c)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def _nearest_first(cfgs: list[dict], ref: dict, limit: Optional[int]) -> list[dict]:
    if not limit or len(cfgs) <= limit:
        return cfgs

    def dist(c):
        return sum(abs(math.log2(c[k]) - math.log2(ref.get(k, c[k]))) for k in ss.KEYS)

    return sorted(cfgs, key=dist)[:limit]


def halving_evals(n: int, rounds, eta: int, keep: int) -> int:
    total = 0
    for _ in rounds:
        total += n
        n = min(n, max(keep, math.ceil(n / eta)))
    return total


class Searcher:
    """Runs the per-batch-size search for one target; owns the progress display and the compile pool."""

    def __init__(self, target, opts: TuneOptions, device, limits: ss.Limits, precompiler=None, progress=None):
        self.target, self.opts, self.device, self.limits = target, opts, device, limits
        self.precompiler, self.progress = precompiler, progress
        self.task = None
        self.best = math.inf

    # progress ------------------------------------------------------------------
    def _add_total(self, n: int) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, total=(self.progress.tasks[self._index()].total or 0) + n)

    def _index(self) -> int:
        return next(i for i, t in enumerate(self.progress.tasks) if t.id == self.task)

    def _on_result(self, trial) -> None:
        if trial.error is None and trial.us < self.best:
            self.best = trial.us
        if self.progress is not None and self.task is not None:
            best = f"best {self.best:9.1f} us" if math.isfinite(self.best) else "best        -"
            self.progress.update(self.task, advance=1, best=best)

    # stages --------------------------------------------------------------------
    def _compile(self, bench, m: int, cfgs: list[dict]) -> None:
        if self.precompiler is None or not cfgs:
            return
        failed = self.precompiler.compile(self.target.kind, self.target.shape, [(m, c) for c in cfgs])
        for c in cfgs:
            err = failed.get(ss.config_key(c))
            if err is not None:
                bench.trial(c).error = err

    def _halve(self, bench, cfgs: list[dict], rounds) -> list:
        self._add_total(halving_evals(len(cfgs), rounds, self.opts.eta, self.opts.keep))
        return successive_halving(bench, cfgs, rounds, self.opts.eta, self.opts.keep, self._on_result)

    def _new(self, bench, cfgs: list[dict]) -> list[dict]:
        return [c for c in _dedupe(cfgs) if ss.config_key(c) not in bench.trials]

    def search(self, bench, m: int, seeds: list[dict]) -> list[dict]:
        """The finalists for batch size m (configs, best guesses first)."""
        o, t = self.opts, self.target
        default = seeds[0]
        if o.exhaustive:
            cands = t.candidates(m, self.limits, o.full, batch_prune=False).kept
            self._compile(bench, m, cands)
            ranked = self._halve(bench, _dedupe(cands + seeds), (o.exhaustive_reps,))
            return [r.cfg for r in ranked[:5] if r.error is None]
        cands = _nearest_first(t.candidates(m, self.limits, o.coarse).kept, default, o.max_configs)
        self._compile(bench, m, cands)
        ranked = self._halve(bench, _dedupe(cands + seeds), o.rounds)
        top = [r.cfg for r in ranked[: o.top] if r.error is None]
        if not top:
            return []
        later = o.rounds[1:] or o.rounds
        near = _nearest_first(self._new(bench, t.refine(top, m, self.limits, o.full)), top[0], o.max_configs)
        self._compile(bench, m, near)
        ranked = self._halve(bench, _dedupe(top + near), later)
        best = ranked[0].cfg
        finalists = [r.cfg for r in ranked[: o.keep] if r.error is None]
        downs = _nearest_first(self._new(bench, t.down(best, self.limits, o.full)), best, o.max_configs)
        if downs:
            self._compile(bench, m, downs)
            ranked_down = self._halve(bench, [best] + downs, later)
            combined = self._combine(bench, best)
            if combined is not None:
                self._compile(bench, m, [combined])
            finalists = [r.cfg for r in ranked_down[: o.keep] if r.error is None] + finalists
            if combined is not None:
                finalists.append(combined)
        return _dedupe(finalists)

    def _combine(self, bench, best: dict) -> Optional[dict]:
        """Every down-GEMM key change that beat `best` on its own, applied together."""
        base_us = bench.trial(best).us
        base = ss.down_part(best)
        gains: dict[str, tuple[float, int]] = {}
        for trial in bench.trials.values():
            cfg = trial.cfg
            if trial.error is not None or ss.up_part(cfg) != ss.up_part(best) or trial.us >= base_us:
                continue
            diff = {k: v for k, v in ss.down_part(cfg).items() if base.get(k) != v}
            if len(diff) == 1:
                (k, v), = diff.items()
                if k not in gains or trial.us < gains[k][0]:
                    gains[k] = (trial.us, v)
        if len(gains) < 2:
            return None
        combined = ss.with_down(best, {k: v for k, (_, v) in gains.items()})
        return None if ss.config_key(combined) in bench.trials else combined

    def tune_batch(self, m: int, existing: Optional[dict]) -> BatchResult:
        t0 = time.perf_counter()
        self.best = math.inf
        problem = self._problem()
        bench = Bench(problem, m, Timer(self.device))
        default = self.target.default_config(m)
        seeds = _dedupe([default] + ([existing] if existing else []))
        finalists = self.search(bench, m, seeds)
        extras = [e for c in finalists[:1] for e in self.target.extras(c, self.device)]
        final = _dedupe(finalists + extras + seeds)
        self._add_total(len(final) * 3)
        ranked = final_ranking(bench, final, self.opts.final_reps, passes=3, on_result=self._on_result)
        winner, err = self._first_correct(bench, ranked)
        ranked_cfgs = [r.cfg for r in sorted(bench.trials.values(), key=lambda r: r.us) if r.error is None]
        winner_cfg = self.target.finalize(winner.cfg, ranked_cfgs) if winner else dict(default)
        res = BatchResult(
            m=m, config=winner_cfg, tuned_us=winner.us if winner else None,
            default_us=bench.trial(default).us, existing_us=bench.trial(existing).us if existing else None,
            timed=sum(1 for r in bench.trials.values() if r.samples or r.error), seconds=time.perf_counter() - t0,
            error=err, note="" if winner else "no config passed the numerical check: kept the default")
        del bench
        return res

    def _first_correct(self, bench, ranked):
        for trial in ranked:
            if trial.error is not None or not math.isfinite(trial.us):
                continue
            if not self.opts.check:
                return trial, None
            err = bench.check(trial.cfg)
            if err <= bench.problem.tolerance():
                return trial, err
            trial.error = f"numerical check failed: relative error {err:.3g}"
        return None, None

    _problem_cache = None

    def _problem(self):
        if self._problem_cache is None:
            self._problem_cache = self.target.problem(self.device, self.opts.seed)
        return self._problem_cache


# --------------------------------------------------------------------------- driver


def make_precompiler(opts: TuneOptions, device):
    """A compile pool on a GPU (not under the Triton interpreter), or None."""
    workers = opts.workers or default_workers()
    if torch.device(device).type != "cuda" or interpreting() or workers <= 1:
        return None
    return Precompiler(workers, torch.device(device).index or 0)


def tune(target, opts: TuneOptions, device="cuda", console=None, precompiler=None) -> TuneReport:
    """Tune `target` for opts.batch_sizes; writes opts.out_dir/<file name> after each batch size."""
    console = console or Console()
    t0 = time.perf_counter()
    out = Path(opts.out_dir) / target.filename(opts.device_name)
    done = load_done(target, opts, out)
    _, installed = installed_configs(target, opts)
    todo = [m for m in opts.batch_sizes if m not in done]
    report = TuneReport(target.title(), out, dict(done), list(opts.batch_sizes))
    if done:
        console.print(f"resuming: {len(done)} batch size(s) already in {out.name}, {len(todo)} to go")
    own_pool = precompiler is None
    if own_pool and todo:
        try:
            precompiler = make_precompiler(opts, device)
        except Exception as exc:  # noqa: BLE001 - compile inline instead
            console.print(f"[yellow]compile workers unavailable ({exc}); compiling in this process[/]")
    built0 = (precompiler.kernels_built, precompiler.seconds) if precompiler else (0, 0.0)
    limits = ss.Limits.for_device(device) if str(device).startswith("cuda") else ss.Limits()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            searcher = Searcher(target, opts, device, limits, precompiler, progress)
            for i, m in enumerate(todo):
                if opts.time_limit is not None and time.perf_counter() - t0 > opts.time_limit:
                    report.skipped = todo[i:]
                    break
                searcher.task = progress.add_task(f"M={m:<5}", total=0, best="best        -")
                existing = _nearest(installed, m)
                res = searcher.tune_batch(m, existing)
                report.results[m] = res
                last = i + 1 == len(todo)
                save(target, opts, out, report.results, complete=last and not report.skipped)
                report.seconds = time.perf_counter() - t0
                save_results(report, opts)
                best = f"{res.tuned_us:9.1f} us" if res.tuned_us else "-"
                progress.update(searcher.task, description=f"M={m:<5} done", best=f"tuned {best}")
    finally:
        if precompiler is not None:
            report.compile_seconds = precompiler.seconds - built0[1]
            report.kernels_built = precompiler.kernels_built - built0[0]
            if own_pool:
                precompiler.close()
    if not todo and done:
        save(target, opts, out, report.results, complete=True)
    report.seconds = time.perf_counter() - t0
    save_results(report, opts)
    return report


def _nearest(configs: dict[int, dict], m: int) -> Optional[dict]:
    return nearest_config(configs, m) if configs else None


# --------------------------------------------------------------------------- output


def _us(v: Optional[float]) -> str:
    return f"{v:.1f}" if v is not None and math.isfinite(v) else "-"


def report_layouts(report: TuneReport) -> list:
    """The tuned-vs-default table: every column, then (narrow terminals) the essential ones."""
    title = f"{report.title}: tuned vs default config"
    wide, narrow = Table(title=title), Table(title=title)
    for col in ("M", "default\nus", "tuned\nus", "speed-up", "installed\nus", "configs\ntimed", "s"):
        wide.add_column(col, justify="right", no_wrap=True)
    for col in ("M", "default\nus", "tuned\nus", "speed-up"):
        narrow.add_column(col, justify="right", no_wrap=True)
    wide.add_column("tuned config")
    narrow.add_column("tuned config")
    for m in sorted(report.results):
        r = report.results[m]
        sp = f"{r.speedup:.2f}x" if r.speedup else "-"
        config = ss.describe(r.config) + (f" ({r.note})" if r.note else "")
        wide.add_row(str(m), _us(r.default_us), _us(r.tuned_us), sp, _us(r.existing_us), str(r.timed or "-"),
                     f"{r.seconds:.0f}" if r.seconds else "-", config)
        narrow.add_row(str(m), _us(r.default_us), _us(r.tuned_us), sp, config)
    return [wide, narrow]


def print_report(report: TuneReport, console, show=None) -> None:
    """Print the table (`show(console, layouts)` picks a layout; default: the widest) and the summary."""
    layouts = report_layouts(report)
    if show is None:
        console.print(layouts[0])
    else:
        show(console, layouts)
    line = f"wrote {report.path} in {report.seconds:.0f} s"
    if report.kernels_built:
        line += f" ({report.kernels_built} kernels compiled by workers in {report.compile_seconds:.0f} s)"
    console.print(line)
    if report.skipped:
        console.print(f"[yellow]time limit reached before batch sizes {report.skipped}; "
                      "run again with --resume to finish[/]")
