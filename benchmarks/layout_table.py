"""One table over several `dsctl serve` sweeps, one row per layout: start-up to healthy, weights and KV tokens per
rank (from the ranks' start-up lines), the batch-1 step (TPOT at concurrency 1) against its bytes floor, output
tok/s at every concurrency (with --baseline: over that sweep's, level by level) and the failed requests.

benchmarks/serve_sweep.sh writes one `<tag>.summary.json` per sweep (`summary` below); this reads them:

    python3 benchmarks/layout_table.py DIR [--baseline TAG]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from typing import Optional

RANK0 = re.compile(r"rank 0: weights ([\d.]+) GB, KV pool (\d+) tokens")
DP_POOLS = re.compile(r"KV cache: (\d+) DP attention groups x ([\d/]+) tokens")


def _stat(record: dict, key: str, q: str) -> Optional[float]:
    return (record.get(key) or {}).get(q)


def summary(tag: str, layout: str, model: str, extra: str, healthy_s: float, bw: float, log: str,
            records: list[dict]) -> dict:
    """A sweep in one JSON-able dict: the server's start-up and memory from its log, then one entry per level
    from `dsctl bench serving`'s records (with `floor_ms` where the sweep computed it)."""
    rank0, dp = RANK0.search(log), DP_POOLS.search(log)
    levels = [{"conc": r["flags"]["max_concurrency"], "completed": r["completed"], "failed": r["failed"],
               "out_tok_s": r["output_throughput"], "ttft_p50_ms": _stat(r, "ttft_ms", "median"),
               "itl_p50_ms": _stat(r, "itl_ms", "median"), "itl_p99_ms": _stat(r, "itl_ms", "p99"),
               "tpot_p50_ms": _stat(r, "tpot_ms", "median"), "floor_ms": r.get("floor_ms")} for r in records]
    return {"tag": tag, "layout": layout, "model": model, "extra": extra, "healthy_s": healthy_s,
            "copy_bandwidth": None if math.isnan(bw) else bw,
            "weights_gb": float(rank0[1]) if rank0 else None, "kv_tokens_per_rank": int(rank0[2]) if rank0 else None,
            "dp_groups": int(dp[1]) if dp else 1, "levels": levels}


def _by_conc(s: dict) -> dict[int, dict]:
    return {lv["conc"]: lv for lv in s["levels"]}  # a level run twice under one tag: the last run


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(summaries: list[dict], baseline: Optional[str] = None) -> str:
    concs = sorted({c for s in summaries for c in _by_conc(s) if c > 1})
    base = next((_by_conc(s) for s in summaries if s["tag"] == baseline), None)
    if baseline and base is None:
        raise SystemExit(f"no sweep tagged {baseline!r} among {[s['tag'] for s in summaries]}")
    head = ["layout", "healthy s", "weights GB", "KV tokens / rank", "TPOT c=1 ms (floor)", "x floor"] + \
        [f"tok/s c={c}" for c in concs] + ["failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in summaries:
        levels = _by_conc(s)
        one = levels.get(1, {})
        tpot, floor = one.get("tpot_p50_ms"), one.get("floor_ms")
        kv = _fmt(s["kv_tokens_per_rank"], ",") + (f" x {s['dp_groups']}" if s["dp_groups"] > 1 else "")
        cells = [s["tag"], _fmt(s["healthy_s"], ".1f"), _fmt(s["weights_gb"], ".2f"), kv,
                 f"{_fmt(tpot, '.2f')} ({_fmt(floor, '.2f')})", _fmt(tpot / floor if tpot and floor else None, ".2f")]
        for c in concs:
            lv = levels.get(c)
            cell = _fmt(lv["out_tok_s"], ",.0f") if lv else "-"
            if lv and base and c in base and base[c]["out_tok_s"]:
                cell += f" ({lv['out_tok_s'] / base[c]['out_tok_s']:.2f}x)"
            cells.append(cell)
        failed = sum(lv["failed"] for lv in levels.values())
        cells.append(f"{failed} of {failed + sum(lv['completed'] for lv in levels.values())}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load(directory: str) -> list[dict]:
    paths = glob.glob(os.path.join(directory, "**", "*.summary.json"), recursive=True)
    paths.sort(key=lambda p: (os.path.getmtime(p), p))  # in the order the sweeps ran
    return [json.load(open(p)) for p in paths]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="where serve_sweep.sh wrote its <tag>.summary.json files (searched recursively)")
    p.add_argument("--baseline", help="the tag whose output tok/s the other rows are divided by, level by level")
    args = p.parse_args(argv)
    summaries = load(args.directory)
    if not summaries:
        raise SystemExit(f"no *.summary.json under {args.directory}")
    print(table(summaries, args.baseline))


if __name__ == "__main__":
    main()
