"""Optional PNG: latency CDFs (TTFT, TPOT, ITL, E2E) and output throughput over time (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsctl.bench_serving.client import RequestResult
from engine.errors import UsageError


def _pyplot():
    try:
        import matplotlib  # lazy: optional dependency (dsctl[bench]), imported only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: optional dependency; after matplotlib.use("Agg")
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or dsctl[bench])") from None
    return plt


def throughput_series(results: list[RequestResult], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, output tokens/s per bin); each request's tokens are spread over its text chunks."""
    times, weights = [], []
    for r in results:
        if r.ok and r.chunk_times:
            per_chunk = r.output_len / len(r.chunk_times)
            times += [r.start + t for t in r.chunk_times]
            weights += [per_chunk] * len(r.chunk_times)
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def write_plot(results: list[RequestResult], path: Path, title: str) -> None:
    plt = _pyplot()
    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok if r.ttft is not None],
        "TPOT": [r.tpot for r in ok if r.tpot is not None],
        "ITL": [g for r in ok for g in r.itl],
        "E2E": [r.latency for r in ok],
    }
    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in series.items():
        if values:
            ms = np.sort(np.asarray(values)) * 1000.0
            cdf.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of requests / gaps")
    cdf.set_title("latency CDFs")
    cdf.legend()
    cdf.grid(True, alpha=0.3)
    t, rate = throughput_series(results)
    tput.step(t, rate, where="post")
    tput.set_xlabel("time since start (s)")
    tput.set_ylabel("output tokens/s")
    tput.set_title("output throughput over time")
    tput.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
