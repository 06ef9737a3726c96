"""The scheduler's step times by kind between two scrapes of a server's /metrics (dsctl_step_seconds).

    python3 benchmarks/step_times.py BEFORE.txt AFTER.txt

Prints, per kind (decode, extend, mixed, spec): steps, mean ms, the bucket bounds that hold the
median and the 99th percentile (the histogram's resolution: engine/scheduler/step_times.py BUCKETS), and
how many steps took longer than 30, 50, 100, 200 and 500 ms (a stream's inter-token gap is the step that
carries its token: steps over 4x the decode median are what an ITL p99 past 4x is made of).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.scheduler.step_times import BUCKETS  # noqa: E402

_LINE = re.compile(r'^dsctl_step_seconds_(bucket|sum|count)\{kind="(\w+)"(?:,le="([^"]+)")?\} (\S+)$')


def parse(text: str) -> dict:
    """{kind: {"buckets": {le: cumulative count}, "sum": s, "count": n}}"""
    out: dict = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        what, kind, le, value = m.groups()
        k = out.setdefault(kind, {"buckets": {}, "sum": 0.0, "count": 0.0})
        if what == "bucket":
            k["buckets"][le] = float(value)
        else:
            k[what] = float(value)
    return out


def quantile_bound(buckets: list[tuple[str, float]], q: float) -> str:
    """The upper bound of the bucket holding quantile q (buckets: (le, count in the window), cumulative)."""
    total = buckets[-1][1]
    for le, cum in buckets:
        if total and cum >= q * total:
            return f"> {BUCKETS[-1]:g} s" if le == "+Inf" else f"<= {float(le) * 1e3:g} ms"
    return "-"


OVER_S = (0.03, 0.05, 0.1, 0.2, 0.5)  # bucket edges: steps longer than each are counted


def over(window: list[tuple[str, float]], edge: float) -> float:
    """Steps in the window longer than `edge` seconds (a bucket edge)."""
    total = window[-1][1]
    return total - next((c for le, c in window if le != "+Inf" and float(le) == edge), total)


def table(before: dict, after: dict) -> list[str]:
    lines = [f"{'kind':<7} {'steps':>6} {'mean ms':>8} {'p50':>12} {'p99':>12} "
             + " ".join(f"{'>' + format(e * 1e3, 'g') + 'ms':>7}" for e in OVER_S)]
    for kind in sorted(after):
        a, b = after[kind], before.get(kind, {"buckets": {}, "sum": 0.0, "count": 0.0})
        n = a["count"] - b["count"]
        if n <= 0:
            continue
        window = [(le, c - b["buckets"].get(le, 0.0)) for le, c in a["buckets"].items()]
        lines.append(f"{kind:<7} {n:>6.0f} {(a['sum'] - b['sum']) / n * 1e3:>8.2f} "
                     f"{quantile_bound(window, 0.5):>12} {quantile_bound(window, 0.99):>12} "
                     + " ".join(f"{over(window, e):>7.0f}" for e in OVER_S))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    before, after = (parse(open(p).read()) for p in argv)
    print("\n".join(table(before, after)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
