"""The start-up heap and Python's cyclic garbage collector.

What start-up builds (imported modules, the model's Python objects, the HTTP stack) lives as long as
the process, yet every full (generation 2) collection traverses it: 360k tracked objects and 124-128 ms
per full collection in benchmarks/bench_host_overhead.py's process on a 2-core CPU host (2.8 ms with
that heap frozen). While a server is loaded every stream stalls for such a pause.
`freeze_startup_heap` collects once, then moves every surviving object to the permanent generation
(`gc.freeze`), so that later collections traverse only what serving allocated; `warn_slow_collections`
logs any collection that still pauses the process for long, so that a stall in the serving metrics can
be told apart from one on the GPU.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

SLOW_COLLECTION_S = 0.05  # a collection pausing the process longer than this is logged


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze every object alive now out of later collections; returns how many were frozen."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection (%.0f ms)", process, frozen,
             1e3 * (time.perf_counter() - t))
    return frozen


def on_collections(report: Callable[[int, float, dict], None]) -> Callable:
    """Call report(generation, seconds it paused the process, gc's info) after every garbage collection in this
    process; returns the callback registered in gc.callbacks (remove it to stop)."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            report(info["generation"], time.perf_counter() - started[0], info)

    gc.callbacks.append(callback)
    return callback


def warn_slow_collections(process: str, threshold_s: float = SLOW_COLLECTION_S) -> Callable:
    """Log a warning for every garbage collection in this process that takes longer than threshold_s; returns
    the callback (registered in gc.callbacks: remove it to stop)."""
    def report(generation: int, took: float, info: dict) -> None:
        if took > threshold_s:
            log.warning("%s: a generation-%d garbage collection paused the process for %.0f ms (%d objects "
                        "collected)", process, generation, 1e3 * took, info["collected"])

    return on_collections(report)
