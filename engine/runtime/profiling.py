"""On-demand profiles of the serving engine (`POST /start_profile`, `POST /stop_profile`, with --profile-dir).

Every rank runs torch.profiler between the two messages (CPU activity, and CUDA kernels on GPUs) and writes a
Chrome trace (`<stamp>-rank<k>.trace.json`: chrome://tracing or Perfetto). Each rank also sums, from the same
events, how much time its collectives took and how much of it nothing else ran beside (`exposed`): the kernels'
intervals on the GPU (NCCL's, the custom all-reduce's, all-to-all), else the host's top-level operators on CPU
(gloo), read back from the written trace. Overlap (two-batch overlap, async collectives) shows as communication
time that is not exposed. Recording slows the engine, and starting and writing a profile stall it (seconds for a
long window): profile a short window, and read latency figures from runs without it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch

log = logging.getLogger(__name__)

# kernel / operator names of communication: NCCL kernels, the custom all-reduce's Triton kernels, torch's c10d
# ops (gloo on CPU)
COMM_NAME = re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|all_?to_?all|reduce_?scatter|broadcast|one_shot|"
                       r"two_shot", re.IGNORECASE)

Interval = tuple[float, float]  # (start, end) in microseconds


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as disjoint intervals, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time in both of two disjoint, ordered interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class CommSummary:
    """One rank's profile: where its time went, in ms."""

    rank: int
    source: str  # "cuda kernels" or "cpu ops" (no kernel was recorded)
    span_ms: float  # first event's start to the last one's end
    busy_ms: float  # some event running
    comm_ms: float  # a collective running
    exposed_comm_ms: float  # a collective running and nothing else
    steps: int = 0  # engine steps this rank ran while recording (the figures per step: divide by it)
    trace: str = ""
    error: str = ""


def summarize(rank: int, events: list[tuple[str, float, float]], source: str) -> CommSummary:
    """(name, start us, end us) of the profiled kernels or top-level operators -> the rank's summary."""
    if not events:
        return CommSummary(rank, source, 0.0, 0.0, 0.0, 0.0)
    comm = merged((s, e) for n, s, e in events if COMM_NAME.search(n))
    other = merged((s, e) for n, s, e in events if not COMM_NAME.search(n))
    busy = merged([*comm, *other])
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    comm_us = length(comm)
    return CommSummary(rank, source, span / 1e3, length(busy) / 1e3, comm_us / 1e3,
                       (comm_us - overlap(comm, other)) / 1e3)


def top_level(events: list[tuple[str, float, float, object]]) -> list[tuple[str, float, float]]:
    """(name, start, end, thread) host operators -> those no other operator of their thread contains."""
    out, ends = [], {}
    for name, start, end, tid in sorted(events, key=lambda e: (e[1], -e[2])):
        if start >= ends.get(tid, float("-inf")):
            out.append((name, start, end))
            ends[tid] = end
    return out


def trace_events(path: str) -> tuple[list[tuple[str, float, float]], str]:
    """A written Chrome trace's CUDA kernels, else (CPU) its top-level host operators: (name, start us, end us).
    Read back from the file: parsing it is an order of magnitude faster than the profiler's own event tree."""
    with open(path) as f:
        spans = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans if e.get("cat") == "kernel"]
    if kernels:
        return kernels, "cuda kernels"
    ops = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid")) for e in spans
           if e.get("cat") == "cpu_op"]
    return top_level(ops), "cpu ops"


class RankProfiler:
    """One rank's profile between `start` and `stop`. `active` follows the messages alone (the same on every rank,
    whether or not this rank's profiler could start), so every rank takes part in the same stops."""

    def __init__(self, directory: str, rank: int, device: torch.device):
        self.directory, self.rank, self.device = directory, rank, device
        self.prof: Optional[torch.profiler.profile] = None
        self.active, self.stamp, self.steps, self.max_steps, self.error = False, "", 0, 0, ""

    @property
    def due(self) -> bool:
        """The profile has run its `max_steps` steps: rank 0 then stops it on every rank."""
        return self.active and 0 < self.max_steps <= self.steps

    def start(self, stamp: str, max_steps: int = 0) -> None:
        """Start recording for at most `max_steps` engine steps (0: until stopped); `stamp` names this profile's
        files on every rank. A second start while one is active is ignored; a failure is reported at the stop."""
        if self.active:
            return
        self.active, self.stamp, self.steps, self.max_steps, self.error = True, stamp, 0, max_steps, ""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot start must not stop serving
            log.exception("rank %d: starting the profiler failed", self.rank)
            self.prof, self.error = None, f"{type(exc).__name__}: {exc}"
            return
        log.info("profiling rank %d (%s) for %s", self.rank, stamp,
                 f"{max_steps} steps" if max_steps else "until POST /stop_profile")

    def count_step(self) -> None:
        """One engine step ran (counted while active)."""
        self.steps += self.active

    def stop(self) -> Optional[CommSummary]:
        """Stop, write the trace, sum the communication (None when no profile is active); a failure is reported in
        the summary, not raised."""
        if not self.active:
            return None
        self.active = False
        prof, self.prof = self.prof, None
        if prof is None:
            return CommSummary(self.rank, "", 0.0, 0.0, 0.0, 0.0, steps=self.steps, error=self.error)
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            prof.stop()
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"{self.stamp}-rank{self.rank}.trace.json")
            prof.export_chrome_trace(path)
            summary = summarize(self.rank, *trace_events(path))
            summary.trace, summary.steps = path, self.steps
            return summary
        except Exception as exc:  # noqa: BLE001 - a profile that cannot be written must not stop serving
            log.exception("rank %d: writing the profile failed", self.rank)
            return CommSummary(self.rank, "", 0.0, 0.0, 0.0, 0.0, steps=self.steps, error=f"{type(exc).__name__}: {exc}")


def profile_stamp() -> str:
    """A name for one profile's files, the same on every rank (chosen by the serving process)."""
    return time.strftime("%Y%m%d-%H%M%S")


def as_json(summaries: list[CommSummary]) -> list[dict]:
    return [asdict(s) for s in summaries]
