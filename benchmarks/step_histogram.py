"""The server's step times over one benchmark level: two /metrics scrapes in, one line per step kind out.

`dsctl_step_seconds` (engine/scheduler/step_times.py) is cumulative; this prints what happened between the two
scrapes: steps of each kind, their mean, and how many took longer than a few edges. A stream's inter-token gap
is the step that carries its token, so steps over 4x the decode median are what an ITL p99 past 4x is made of.
    python3 benchmarks/step_histogram.py before.prom after.prom
"""

from __future__ import annotations

import sys

from prometheus_client.parser import text_string_to_metric_families

SHOWN_EDGES = ("0.03", "0.05", "0.1", "0.2", "0.5")  # seconds: steps longer than each are counted


def step_buckets(path: str) -> dict[str, dict[str, float]]:
    """{kind: {bucket edge or "sum": cumulative value}} of dsctl_step_seconds in one scrape ({} when absent)."""
    out: dict[str, dict[str, float]] = {}
    with open(path) as f:
        families = list(text_string_to_metric_families(f.read()))
    for family in families:
        if family.name != "dsctl_step_seconds":
            continue
        for sample in family.samples:
            kind = out.setdefault(sample.labels["kind"], {})
            if sample.name.endswith("_bucket"):
                kind[str(float(sample.labels["le"])) if sample.labels["le"] != "+Inf" else "+Inf"] = sample.value
            elif sample.name.endswith("_sum"):
                kind["sum"] = sample.value
    return out


def level_lines(before: dict, after: dict) -> list[str]:
    lines = []
    for kind, now in sorted(after.items()):
        was = before.get(kind, {})
        delta = {k: v - was.get(k, 0.0) for k, v in now.items()}
        n = delta.get("+Inf", 0.0)
        if n <= 0:
            continue
        over = " ".join(f">{float(e) * 1000:.0f}ms {n - delta.get(str(float(e)), 0.0):.0f}" for e in SHOWN_EDGES)
        lines.append(f"  {kind:<7} {n:6.0f} steps, mean {1000 * delta.get('sum', 0.0) / n:7.2f} ms; {over}")
    return lines


if __name__ == "__main__":
    print("\n".join(level_lines(step_buckets(sys.argv[1]), step_buckets(sys.argv[2]))) or "  no step times")
