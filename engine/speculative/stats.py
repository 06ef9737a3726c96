"""Accepted tokens per speculative step: a histogram over 1..num_steps + 1 and its mean.

One entry per request and step: the tokens that step emitted for it (the accepted draft tokens plus
the target's bonus token, counted before a stop cuts them). The scheduler's `stats()` reports them;
the server exports them on /metrics and `dsctl bench one-batch` / `bench offline` print them.
"""

from __future__ import annotations

from typing import Optional, Sequence


def mean_accepted(before: Sequence[int], after: Sequence[int]) -> Optional[float]:
    """The mean tokens per request-step between two snapshots of a cumulative histogram (`hist`); None
    when no spec step ran in between (speculation off, or every step plain)."""
    grew = [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    steps = sum(grew)
    return sum((i + 1) * c for i, c in enumerate(grew)) / steps if steps else None


class SpecStats:
    def __init__(self, max_tokens: int):
        self.hist = [0] * max_tokens  # hist[i]: request-steps that emitted i + 1 tokens
        self.plain_steps = 0  # decode steps run without speculation (--speculative-disable-by-batch-size)

    def record(self, counts: list[int]) -> None:
        for n in counts:
            self.hist[n - 1] += 1

    @property
    def steps(self) -> int:
        return sum(self.hist)

    @property
    def mean(self) -> float:
        return mean_accepted((), self.hist) or 0.0

    def as_dict(self) -> dict:
        return {"spec_accept_mean": self.mean, "spec_accept_hist": tuple(self.hist),
                "spec_plain_steps": self.plain_steps}
