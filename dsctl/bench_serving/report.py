"""Benchmark output: a rich table, one JSON line appended to --result-file."""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsctl.bench_serving.metrics import Summary

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms"))


def render(summary: Summary, console: Console, title: str) -> None:
    s = summary
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("duration (s)", f"{s.duration_s:.2f}"),
        ("completed / failed requests", f"{s.completed} / {s.failed}"),
        ("input / output tokens", f"{s.input_tokens} / {s.output_tokens}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("input token throughput (tok/s)", f"{s.input_throughput:.1f}"),
        ("output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{s.total_throughput:.1f}"),
        ("achieved concurrency", f"{s.concurrency:.2f}"),
    ]
    if s.goodput is not None:
        rows.append(("goodput (req/s within SLO)", f"{s.goodput:.2f} ({s.slo_met} requests)"))
    for label, key in rows:
        table.add_row(label, key)
    if s.counted_by:
        table.add_row("tokens counted by", ", ".join(f"{k}: {v}" for k, v in sorted(s.counted_by.items())))
    console.print(table)
    latency = Table(title_justify="left")
    for name in ("latency (ms)", "mean", "median", "p90", "p99"):
        latency.add_column(name, justify="left" if name.startswith("latency") else "right")
    for label, attr in _LATENCIES:
        stat = getattr(s, attr)
        cells = ["n/a"] * 4 if stat is None else [f"{v:.1f}" for v in (stat.mean, stat.median, stat.p90, stat.p99)]
        latency.add_row(label, *cells)
    console.print(latency)
    if s.errors:
        console.print(f"[red]{s.failed} failed request(s):[/]")
        for message, count in s.errors.items():
            console.print(f"  [red]{count} x[/] {escape(message)}", highlight=False)


def record(summary: Summary, flags: dict) -> dict:
    """The JSON object appended to the result file: timestamp, every flag, every metric."""
    return {"timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "flags": {k: _plain(v) for k, v in flags.items()},
            **dataclasses.asdict(summary)}


def _plain(value):
    """Flag values as strict JSON: paths and non-finite floats (request rate inf) as strings."""
    if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
        return str(value)
    return value


def append_result(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
