"""How long the scheduler's steps take, per kind: a cumulative histogram for /metrics.

A step's time is measured where its results are read on the host (for a launched step, when its
sampled tokens are resolved): from the later of its launch and the previous step's completion to its
own completion. With the overlap scheduler a step is launched while the one before still runs, and its
results are read only once the next step is launched: a step's time is the device time spent on it plus
the host work it waited for, including the launch of the step after it (so the cost of a launch-bound eager
step, e.g. a deep model's prefill chunk, shows mostly in the step before it). It is the gap a running
stream sees between two tokens when that step carries them. Kinds: "decode", "extend" (prefill
chunks only), "mixed" (prefill chunks with decodes riding along), "spec" (a speculative step, timed
around its synchronous run).
"""

from __future__ import annotations

import bisect

KINDS = ("decode", "extend", "mixed", "spec")
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class StepTimes:
    def __init__(self):
        self.counts = {k: [0] * (len(BUCKETS) + 1) for k in KINDS}  # per kind: per bucket, the last = +Inf
        self.sums = dict.fromkeys(KINDS, 0.0)

    def record(self, kind: str, seconds: float) -> None:
        self.counts[kind][bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sums[kind] += seconds

    def as_dict(self) -> dict[str, tuple[tuple[int, ...], float]]:
        """{kind: (per-bucket counts, not cumulative; the sum of seconds)}, kinds with at least one step."""
        return {k: (tuple(c), self.sums[k]) for k, c in self.counts.items() if any(c)}


def merge(parts: list[dict]) -> dict:
    """Several `as_dict` results (DP attention groups) added up."""
    out: dict[str, tuple[tuple[int, ...], float]] = {}
    for part in parts:
        for kind, (counts, total) in part.items():
            old_counts, old_total = out.get(kind, ((0,) * len(counts), 0.0))
            out[kind] = (tuple(a + b for a, b in zip(old_counts, counts)), old_total + total)
    return out
