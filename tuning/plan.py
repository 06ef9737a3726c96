"""`--dry-run`: the shapes, the search-space sizes after pruning, and a rough time estimate (no GPU needed).

The estimate models compile time (Triton, per config, spread over the compile workers) and
timing (graph capture and replays of every evaluation the staged search makes). Its constants
are estimates not yet calibrated on an H100 (docs/perf.md, "Kernel config tuning"); treat the result as
the order of magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.table import Table

from tuning import search_space as ss
from tuning.runner import TuneOptions, halving_evals

COMPILE_S = {"moe": 2.5, "gemm": 0.8}  # seconds of one CPU core per config (MoE: gate_up + down kernels)
EVAL_OVERHEAD_S = 0.012  # warm-up call, graph capture and instantiation per timed config
REFINE_CONFIGS = {"moe": 30, "gemm": 15}  # stage 2 (+ 3) configs per batch size, about
HBM_BYTES_PER_S = 2.5e12
FP8_FLOP_PER_S = 5e14


@dataclass
class BatchPlan:
    m: int
    candidates: int
    pruned: ss.Pruned
    evals: int
    seconds: float


@dataclass
class Plan:
    title: str
    filename: str
    grid_size: int
    static: ss.Pruned
    batches: list[BatchPlan] = field(default_factory=list)
    kernels: int = 0
    compile_s: float = 0.0
    timing_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compile_s + self.timing_s


def _call_us(target, m: int) -> float:
    """Roofline guess of one kernel call in microseconds (weights streamed once, FP8 tensor-core rate)."""
    if target.kind == "moe":
        s = target.shape
        wbytes = {"fp8_w8a8": 1, "w4afp8": 0.5}.get(s.dtype, 2)
        touched = s.E * (1 - (1 - s.top_k / s.routing.n_experts) ** m)
        nbytes = touched * 3 * s.N * s.K * wbytes + m * s.top_k * s.K * 4
        flops = 2 * m * s.top_k * 3 * s.N * s.K
    else:
        s = target.shape
        nbytes = s.N * s.K + m * (s.K + s.N) * 2
        flops = 2 * m * s.N * s.K
    return max(nbytes / HBM_BYTES_PER_S, flops / FP8_FLOP_PER_S) * 1e6 + 15


def plan(target, opts: TuneOptions, limits: ss.Limits, workers: int) -> Plan:
    grid = opts.full if opts.exhaustive else opts.coarse
    kinds = getattr(target, "kinds", None)
    if target.kind == "moe":
        static = ss.prune(grid.configs(), lambda c: ss.moe_static_reason(c, kinds, limits))
    else:
        static = ss.prune(grid.configs(), lambda c: ss.static_reason(c, target.gemm, limits))
    p = Plan(target.title(), target.filename(opts.device_name), grid.size(), static)
    kernels: set = set()
    for m in opts.batch_sizes:
        pruned = target.candidates(m, limits, grid, batch_prune=not opts.exhaustive)
        n = len(pruned.kept)
        if opts.max_configs and not opts.exhaustive:
            n = min(n, opts.max_configs)
        klass = 0 if target.kind == "moe" else (1 if m == 1 else 16 if m % 16 == 0 else 8)
        kernels |= {(klass, ss.config_key(c)) for c in pruned.kept[:n]}
        if opts.exhaustive:
            evals, reps = n + 7, opts.exhaustive_reps
        else:
            refine = REFINE_CONFIGS[target.kind]
            evals = halving_evals(n + 2, opts.rounds, opts.eta, opts.keep) + halving_evals(
                refine, opts.rounds[1:] or opts.rounds, opts.eta, opts.keep) + 3 * 6
            reps = sum(opts.rounds) / len(opts.rounds)
            kernels |= {(klass, "refine", m, i) for i in range(refine // 2)}  # about half are new
        rotations = max(1, min(8, math.ceil(256 / m))) if target.kind == "moe" else 8
        secs = evals * (EVAL_OVERHEAD_S + (reps + 2) * rotations * _call_us(target, m) * 1e-6)
        p.batches.append(BatchPlan(m, n, pruned, evals, secs))
    p.kernels = len(kernels)
    p.compile_s = p.kernels * COMPILE_S[target.kind] / max(1, workers)
    p.timing_s = sum(b.seconds for b in p.batches)
    return p


def print_plans(plans: list[Plan], opts: TuneOptions, workers: int, console) -> None:
    for p in plans:
        console.print(f"[bold]{p.title}[/]")
        console.print(f"  file: {p.filename}", soft_wrap=True)  # one line, so the name copies whole
        mode = "exhaustive (full grid, every config timed)" if opts.exhaustive else "staged search"
        console.print(f"  {mode}: grid of {p.grid_size} configs; fits the device: {p.static.summary()}")
        table = Table(show_header=True, box=None, pad_edge=False)
        for col in ("M", "candidates", "pruned for M", "evaluations"):
            table.add_column(col, justify="right")
        for b in p.batches:
            batch_drops = {k: v for k, v in b.pruned.dropped.items()
                           if k not in p.static.dropped or v != p.static.dropped[k]}
            drops = ", ".join(f"{v - p.static.dropped.get(k, 0)} {k}" for k, v in batch_drops.items()) or "-"
            table.add_row(str(b.m), str(b.candidates), drops, str(b.evals))
        console.print(table)
        console.print(f"  estimate: {p.kernels} kernels to compile (~{p.compile_s:.0f} s on {workers} workers), "
                      f"~{p.timing_s:.0f} s of timing")
    total = sum(p.total_s for p in plans)
    console.print(f"estimated time: ~{total / 60:.1f} min for {len(plans)} shape(s) and {len(opts.batch_sizes)} "
                  "batch sizes (rough; see docs/perf.md, Kernel config tuning, for measured times)")
