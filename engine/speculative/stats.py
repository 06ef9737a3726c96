"""Accepted tokens per speculative step: a histogram over 1..num_steps + 1 and its mean.

One entry per request and step: the tokens that step emitted for it (the accepted draft tokens plus
the target's bonus token, counted before a stop cuts them). The scheduler's `stats()` reports them;
the server exports them on /metrics and `dsctl bench one-batch` prints them.
"""

from __future__ import annotations


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
        n = self.steps
        return sum((i + 1) * c for i, c in enumerate(self.hist)) / n if n else 0.0

    def as_dict(self) -> dict:
        return {"spec_accept_mean": self.mean, "spec_accept_hist": tuple(self.hist),
                "spec_plain_steps": self.plain_steps}
