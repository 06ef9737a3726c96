"""Summary of a benchmarks/tune_gpu.sh run: tuned-vs-default speed-ups, verify verdicts, stage times.

    python benchmarks/tune_summary.py OUT_DIR [TOTAL_SECONDS]

Reads OUT_DIR/results/*.results.json (written by `dsctl tune-* --report-dir`), OUT_DIR/verify/
verify-*.json (`--verify-exhaustive`) and OUT_DIR/logs/stages.tsv; prints plain text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _us(v) -> str:
    return f"{v:9.1f}" if isinstance(v, (int, float)) else f"{'-':>9}"


def results(out: Path) -> None:
    for path in sorted((out / "results").glob("*.results.json")):
        data = json.loads(path.read_text())
        print(f"\n{data['title']}")
        print(f"  tuning time {data['seconds']:.0f} s for {len(data['results'])} batch sizes "
              f"({data.get('kernels_built', 0)} kernels compiled by workers in {data.get('compile_seconds', 0):.0f} s)"
              + (f"; not reached: {data['skipped']}" if data.get("skipped") else ""))
        print(f"  {'M':>5} {'default us':>10} {'tuned us':>9} {'speed-up':>8}  config")
        for r in data["results"]:
            sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
            cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
            print(f"  {r['m']:>5} {_us(r.get('default_us')):>10} {_us(r.get('tuned_us'))} {sp:>8}  {cfg}")


def verify(out: Path) -> None:
    for path in sorted((out / "verify").glob("verify-*.json")):
        data = json.loads(path.read_text())
        verdict = "PASS" if data["ok"] else "FAIL"
        print(f"\n{data['title']}: {verdict} (tolerance {100 * data['tolerance']:.0f}%)")
        print(f"  {'M':>5} {'staged us':>9} {'best us':>9} {'gap':>7} {'staged s':>8} {'exhaustive s':>12} "
              f"{'configs timed (staged / exhaustive)':>36}")
        for r in data["rows"]:
            gap = f"{100 * r['gap']:+.1f}%" if r.get("gap") is not None else "-"
            print(f"  {r['m']:>5} {_us(r['staged_us'])} {_us(r['best_us'])} {gap:>7} {r['staged_s']:8.0f} "
                  f"{r['exhaustive_s']:12.0f} {r['staged_timed']:>17} / {r['exhaustive_timed']}")


def stages(out: Path) -> None:
    path = out / "logs" / "stages.tsv"
    if not path.is_file():
        return
    print("\nstages (exit 124/130 = stopped by its time limit; results up to then are kept):")
    for line in path.read_text().splitlines():
        name, rc, secs = line.split("\t")
        print(f"  {name:<12} exit {rc:>3}  {secs:>5} s")


def main() -> None:
    out = Path(sys.argv[1])
    results(out)
    verify(out)
    stages(out)
    configs = sorted(p.name for p in (out / "configs").glob("*.json"))
    print(f"\nconfig files ({len(configs)}) in {out / 'configs'}:")
    for name in configs:
        print(f"  {name}")
    if len(sys.argv) > 2:
        print(f"total wall time so far: {sys.argv[2]} s")


if __name__ == "__main__":
    main()
