"""Where engine start-up time goes on a GPU: phases, CUDA-graph capture per batch size, Triton compiles.

    python benchmarks/startup_profile.py [--model deepseek-v3] [--num-layers 5] [--runs 2] [--cuda-graph-max-bs N]
        [--compile-workers 0,16]

Each run is a fresh process building the model runner (`ModelRunner`, what `dsctl serve` builds per
rank) with dummy weights. For each --compile-workers value (--triton-compile-workers; default: the
engine's default) the runs share one new Triton cache directory, so run 1 is a cold start (every
kernel compiled) and later runs find the compiled kernels on disk, as an operator's second start
does. Prints per run: the start-up phases, the parallel precompile, the capture time per batch size
(warm-up forwards + capture) and how many Triton kernels were compiled (new cache entries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO)
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import torch
from engine.args import EngineArgs
from engine.runner.model_runner import ModelRunner
t_import = time.perf_counter() - t0
args = EngineArgs.of(**{kw!r})
t1 = time.perf_counter()
runner = ModelRunner(args)
torch.cuda.synchronize() if torch.cuda.is_available() else None
total = time.perf_counter() - t1
g = runner.graphs
pre = g.precompiled if g else None
print("RESULT " + json.dumps({{"import_s": t_import, "runner_s": total,
    "precompile": None if pre is None else [pre.kernels, pre.missing, pre.compiled, pre.record_s, pre.compile_s],
    "capture": {{str(k): v for k, v in (g.capture_seconds if g else {{}}).items()}}}}))
"""


def _cache_entries(path: str) -> int:
    return sum(1 for _ in os.scandir(path)) if os.path.isdir(path) else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--compile-workers", default="", help="comma-separated --triton-compile-workers values "
                    "(each with its own new Triton cache; default: the engine's default only)")
    opts = ap.parse_args()
    rows = []
    for workers in [int(w) for w in opts.compile_workers.split(",") if w] or [None]:
        kw = dict(model=opts.model, load_format="dummy", num_layers=opts.num_layers)
        if opts.cuda_graph_max_bs:
            kw["cuda_graph_max_bs"] = opts.cuda_graph_max_bs
        if workers is not None:
            kw["triton_compile_workers"] = workers
        rows += _runs(kw, opts.runs, workers)
    print("\n| compile workers | run | process s | runner s | weights s | CUDA graphs s | precompile: kernels found / "
          "not cached / compiled, record s, compile s | new Triton cache entries |\n|---|---:|---:|---:|---|---|---|---:|")
    for r in rows:
        pre = r["precompile"]
        pre = "-" if pre is None else f"{pre[0]} / {pre[1]} / {pre[2]}, {pre[3]:.1f} s, {pre[4]:.1f} s"
        ph = dict(p.rsplit(" ", 2)[:2] for p in r["phases"].split(", ")) if r["phases"] != "?" else {}
        print(f"| {r['workers']} | {r['run']} | {r['wall_s']:.1f} | {r['runner_s']:.1f} | {ph.get('weights', '?')} | "
              f"{ph.get('CUDA graphs', '?')} | {pre} | {r['triton_compiled']} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "startup_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)


def _runs(kw: dict, runs: int, workers) -> list[dict]:
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    rows = []
    for run in range(1, runs + 1):
        before = _cache_entries(cache)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, kw=kw)], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        phases = [ln.split("start-up ", 1)[1] for ln in proc.stderr.splitlines() if "start-up " in ln]
        res = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not res:
            print(f"run {run} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        r = res[0]
        r.update(run=run, workers="default" if workers is None else workers, wall_s=wall,
                 phases=phases[-1] if phases else "?", triton_compiled=_cache_entries(cache) - before)
        rows.append(r)
        cap = {int(k): v for k, v in r["capture"].items()}
        print(f"run {run}: process {wall:.1f} s (imports {r['import_s']:.1f} s, runner {r['runner_s']:.1f} s); "
              f"phases: {r['phases']}; Triton kernels compiled: {r['triton_compiled']}")
        print("  capture s per batch size (largest first): "
              + ", ".join(f"{bs}:{cap[bs]:.2f}" for bs in sorted(cap, reverse=True)))
    return rows


if __name__ == "__main__":
    main()
