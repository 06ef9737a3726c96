"""The DP-attention controller: which DP group runs each new request, and the job-wide view of them.

Every message from the serving process reaches world rank 0 (engine/runtime/rank_loop.py),
which is where this controller lives: before rank 0 broadcasts a step's messages, `route` tags
each one with its target DP group (None: every group, e.g. an abort or a shutdown). Policies
(--load-balance-method):

- round_robin: groups in turn;
- shortest_queue: the group with the fewest running + waiting requests, counting the requests
  sent to it since its last report (ties: the lowest group).

An AddRequest that names a `dp_rank` goes there (tests use it to load one group only). After
each step rank 0 gathers every group's outputs and stats (`merge_stats`), which also refreshes
the loads shortest_queue reads and carries the per-group request counters to /metrics.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from engine.runtime import protocol
from engine.scheduler.step_times import merge


class DPController:
    def __init__(self, dp_size: int, policy: str = "round_robin"):
        if policy not in ("round_robin", "shortest_queue"):
            raise ValueError(f"unknown load balance method {policy!r}")
        self.dp_size, self.policy = dp_size, policy
        self.dispatched = [0] * dp_size  # cumulative requests per group
        self.load = [0] * dp_size  # running + waiting at the last report, plus what was sent since
        self._next = 0

    def pick(self) -> int:
        if self.policy == "round_robin":
            group, self._next = self._next, (self._next + 1) % self.dp_size
            return group
        return min(range(self.dp_size), key=lambda g: (self.load[g], g))

    def route(self, msg) -> Optional[int]:
        """The DP group `msg` is for (None: all of them)."""
        if not isinstance(msg, protocol.AddRequest):
            return None
        group = msg.dp_rank if msg.dp_rank is not None else self.pick()
        if not 0 <= group < self.dp_size:
            raise ValueError(f"dp_rank {group} out of range for {self.dp_size} DP groups")
        self.dispatched[group] += 1
        self.load[group] += 1
        return group

    def merge_stats(self, per_group: list[protocol.EngineStats]) -> protocol.EngineStats:
        """One EngineStats for the job: sums (hit rate: the mean), with the per-group counters."""
        self.load = [s.running + s.waiting for s in per_group]
        first = per_group[0]
        total = {f: sum(getattr(s, f) for s in per_group)
                 for f in ("running", "waiting", "kv_total_tokens", "kv_free_tokens", "prefix_cache_tokens",
                           "retracted_requests", "spec_plain_steps")}
        rate = sum(s.prefix_cache_hit_rate for s in per_group) / len(per_group)
        hists = [s.spec_accept_hist for s in per_group if s.spec_accept_hist]
        accept = tuple(map(sum, zip(*hists))) if hists else ()  # every group has the same buckets
        return replace(first, **total, prefix_cache_hit_rate=rate, dp_requests=tuple(self.dispatched),
                       dp_running=tuple(self.load), step_seconds=merge([s.step_seconds for s in per_group]),
                       spec_accept_hist=accept)
