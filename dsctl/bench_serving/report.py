"""Benchmark output: a rich table, warnings about token counts, one JSON line appended to --result-file, one line
per request in --request-file."""

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
        ("input / output tokens asked", f"{s.asked_input_tokens} / {s.asked_output_tokens}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("input token throughput (tok/s)", f"{s.input_throughput:.1f}"),
        ("output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{s.total_throughput:.1f}"),
        ("achieved concurrency", f"{s.concurrency:.2f}"),
    ]
    if s.goodput is not None:
        rows.append(("goodput (req/s within SLO)", f"{s.goodput:.2f} ({s.slo_met} requests)"))
    if s.spec_accept_length is not None:
        rows.append(("speculative accepted length", f"{s.spec_accept_length:.2f}"))
    busy = s.client_busy
    rows.append(("client processes", f"{s.client_processes}"
                 + (f" (busiest: {busy:.0%} CPU)" if busy is not None else "")))
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


_PROMPT_HINTS = {
    "ids": "the server changed the token-id prompts it was sent",
    "text": "the prompts' lengths were verified with the benchmark's tokenizer; the server's tokenizer counts "
            "differently (pass the server's --tokenizer)",
    "chat": "each message has exactly the tokens asked; the server's chat template adds its own tokens",
    "words": "no tokenizer was found, so prompts are words, not tokens: pass --tokenizer (or --model with a "
             "registry alias) for exact lengths",
}


def length_warnings(summary: Summary, form: str, ignore_eos: bool) -> list[str]:
    """Lines to print where the server's usage counts differ from the lengths asked for.

    form: how prompts were made (ids, text, chat, words) or "file" (ShareGPT / JSONL prompts,
    whose asked lengths are only estimates, so they are not compared).
    """
    s, lines = summary, []
    if s.prompt_len_mismatch and form in _PROMPT_HINTS:
        lines.append(f"{s.prompt_len_mismatch} of {s.completed} prompts differ in length from what was asked "
                     f"(asked {s.asked_input_tokens} tokens in all, the server counted {s.input_tokens}): "
                     f"{_PROMPT_HINTS[form]}")
    if s.output_len_mismatch and ignore_eos:
        lines.append(f"{s.output_len_mismatch} of {s.completed} requests got a different number of output tokens "
                     f"than max_tokens (asked {s.asked_output_tokens} in all, got {s.output_tokens})")
    return lines


BUSY_CLIENT = 0.9  # CPU use of the busiest client process above which its timings are suspect


def client_warnings(summary: Summary, min_duration_s: float = 1.0) -> list[str]:
    """A line to print when the client processes were busy enough to delay reading the streams."""
    busy = summary.client_busy
    if busy is None or busy <= BUSY_CLIENT or summary.duration_s < min_duration_s:
        return []
    return [f"the busiest of {summary.client_processes} client process(es) used {busy:.0%} of a CPU: chunks may "
            "have waited in socket buffers, so ITL and TPOT include the client's own delays; raise --client-processes"]


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


_REQUEST_FIELDS = ("ok", "start", "ttft", "latency", "prompt_len", "output_len", "error", "chunk_times")


def write_requests(path: Path, results: list) -> None:
    """One JSON line per request (RequestResult: times in seconds, chunk times since its send), in send order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.start):
            f.write(json.dumps({k: getattr(r, k) for k in _REQUEST_FIELDS}) + "\n")
