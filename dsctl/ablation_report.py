"""Output of `dsctl bench ablation`: the table (in the seed's shape), JSON lines and a PNG.

The wide table has SGLang's columns: runnable (✅, or ❌ with a footnote giving the
reason), one ✅/➖ column per feature, decode tok/s at batch 1 and output tok/s at
the chosen concurrency. On a narrow terminal the feature columns become one
wrapping "optimisations on" column. The PNG (matplotlib, optional) shows both
throughputs per row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from rich.table import Table
from rich.text import Text

from dsctl.ablation_grid import Feature
from dsctl.bench_ablation import RowResult
from dsctl.tables import print_fitting

ON, OFF, OK, FAILED = "✅", "➖", "✅", "❌"


def _rate(res: RowResult, key: str) -> str:
    return f"{res.result[key]:.1f}" if res.runnable else "N/A"


def _footnotes(results: list[RowResult]) -> dict[str, int]:
    notes: dict[str, int] = {}
    for r in results:
        if not r.runnable and r.reason not in notes:
            notes[r.reason] = len(notes) + 1
    return notes


def _first_result(results: list[RowResult]) -> Optional[dict]:
    return next((r.result for r in results if r.runnable), None)


def title(results: list[RowResult], model: str) -> str:
    first = _first_result(results)
    if first is None:
        return f"bench ablation: {model} (no row could run)"
    return (f"bench ablation: {first['model']} on {first['device']} {first['dtype']}, input {first['input_len']}, "
            f"output {first['output_len']} tokens")


def layouts(results: list[RowResult], features: list[Feature], model: str) -> list:
    notes = _footnotes(results)
    first = _first_result(results)
    conc = first["concurrency"] if first else "C"
    rates = ("decode\ntok/s\nbatch 1", f"output\ntok/s\n{conc} concurrent")
    head = title(results, model)

    def runnable(r: RowResult) -> str:
        return OK if r.runnable else f"{FAILED} [{notes[r.reason]}]"

    wide = Table(title=head)
    wide.add_column("runnable", no_wrap=True)
    for f in features:
        wide.add_column(f.header, justify="center", no_wrap=True)
    for h in rates:
        wide.add_column(h, justify="right", no_wrap=True)
    narrow = Table(title=head)
    narrow.add_column("runnable", no_wrap=True)
    narrow.add_column("optimisations on")
    for h in rates:
        narrow.add_column(h, justify="right", no_wrap=True)
    for r in results:
        rate_cells = (_rate(r, "decode_tok_s_bs1"), _rate(r, "output_tok_s"))
        wide.add_row(runnable(r), *(ON if r.features[f.key] else OFF for f in features), *rate_cells)
        narrow.add_row(runnable(r), ", ".join(f.name for f in features if r.features[f.key]) or "none",
                       *rate_cells)
    return [wide, narrow]


def print_table(results: list[RowResult], features: list[Feature], model: str, console) -> None:
    print_fitting(console, layouts(results, features, model))
    for reason, n in _footnotes(results).items():
        console.print(Text(f"[{n}] {reason}"))


def write_jsonl(path: Path, results: list[RowResult]) -> None:
    """One JSON line per row (the file is rewritten: it is this run's table)."""
    now = time.time()
    with open(path, "w") as f:
        for r in results:
            line = {"row": r.index, "label": r.label, "runnable": r.runnable, "reason": r.reason,
                    "features": r.features, "flags": r.flags, "seconds": round(r.seconds, 3), "log": r.log,
                    "timestamp": now, **r.result}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def write_png(path: Path, results: list[RowResult], head: str) -> Optional[str]:
    """Bar charts of both throughputs per row; returns why it was skipped, or None when written."""
    try:
        import matplotlib  # lazy: optional dependency (dsctl[bench]); the table needs none

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: optional dependency; after matplotlib.use("Agg")
    except ImportError:
        return "matplotlib is not installed (pip install 'dsctl[bench]')"
    labels = [f"{r.index}. {r.label}" for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(results) + 1.8), sharey=True)
    first = _first_result(results)
    conc = first["concurrency"] if first else "C"
    for ax, key, name in ((axes[0], "decode_tok_s_bs1", "decode tok/s at batch 1"),
                          (axes[1], "output_tok_s", f"output tok/s at {conc} concurrent")):
        values = [r.result[key] if r.runnable else 0.0 for r in results]
        ax.barh(range(len(results)), values, color=["tab:blue" if r.runnable else "lightgray" for r in results])
        for i, r in enumerate(results):
            if not r.runnable:
                ax.text(0, i, " not runnable", va="center", fontsize=8, color="tab:red")
        ax.set_title(name)
        ax.set_xlabel("tokens / s")
    axes[0].set_yticks(range(len(results)), labels)
    axes[0].invert_yaxis()
    fig.suptitle(head)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
