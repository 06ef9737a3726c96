"""The DP-attention controller: which DP group runs each new request, and the job-wide view of them.

Every message from the serving process reaches world rank 0 (engine/runtime/rank_loop.py),
which is where this controller lives: before rank 0 broadcasts a step's messages, `route` tags
each one with its target DP group (None: every group, e.g. an abort or a shutdown). Policies
(--load-balance-method; SGLang's names):

- total_tokens (the default): the group with the least projected KV, `load_tokens`: the KV slots
  its requests held at its last report (the prefix cache's evictable slots aside, they are free
  for the taking) plus `request_tokens` of each of its waiting requests, plus `request_tokens` of
  each request sent to it since that report; ties: the fewest requests (as shortest_queue counts
  them), then the lowest group. A group full of long prompts thus stops getting work while it
  would only queue or retract it, however few requests it runs;
- shortest_queue: the group with the fewest running + waiting requests, counting the requests
  sent to it since its last report (ties: the lowest group);
- round_robin: groups in turn.

`request_tokens` counts a request's tokens so far plus the max_new_tokens it has left, clipped at
the scheduler's CLIP_NEW_TOKENS (a request without max_tokens gets the whole context as its limit,
which says nothing of its length; the admission reservation clips it the same way). Running
requests count as the slots they hold, not what they may still generate: with chat-style limits
far above the real output lengths that guess would swamp the measured use (the simulation in
tests/distributed/test_dp_controller.py compares the policies on a mix of long and short prompts).

An AddRequest that names a `dp_rank` goes there (tests use it to load one group only). After
each step rank 0 gathers every group's outputs and stats (`merge_stats`), which also refreshes
the loads the policies read and carries the per-group counters to /metrics. A request that a step
finishes is released by the group's next step (its last output goes out first), so its slots weigh
in the load until that step's report.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

from engine.runtime import protocol
from engine.scheduler.admission import CLIP_NEW_TOKENS
from engine.scheduler.step_times import merge

POLICIES = ("total_tokens", "shortest_queue", "round_robin")
DEFAULT_POLICY = "total_tokens"


def request_tokens(num_tokens: int, new_tokens_left: int) -> int:
    """The KV a request is expected to take: its tokens so far plus what it may still generate, clipped."""
    return num_tokens + max(0, min(new_tokens_left, CLIP_NEW_TOKENS))


def waiting_tokens(waiting: Iterable) -> int:
    """`request_tokens` summed over a scheduler's waiting requests (engine.scheduler.request.Request)."""
    return sum(request_tokens(len(r.token_ids), r.params.max_new_tokens - r.num_output) for r in waiting)


def load_tokens(s: protocol.EngineStats) -> int:
    """A group's KV load at its report, as total_tokens weighs it (see the module docstring)."""
    return s.kv_total_tokens - s.kv_free_tokens - s.kv_evictable_tokens + s.waiting_tokens


class DPController:
    def __init__(self, dp_size: int, policy: Optional[str] = None):
        policy = policy or DEFAULT_POLICY
        if policy not in POLICIES:
            raise ValueError(f"unknown load balance method {policy!r}")
        self.dp_size, self.policy = dp_size, policy
        self.dispatched = [0] * dp_size  # cumulative requests per group
        self.load = [0] * dp_size  # running + waiting at the last report, plus what was sent since
        self.tokens = [0] * dp_size  # load_tokens at the last report, plus request_tokens of what was sent since
        self._next = 0

    def pick(self) -> int:
        if self.policy == "round_robin":
            group, self._next = self._next, (self._next + 1) % self.dp_size
            return group
        if self.policy == "shortest_queue":
            return min(range(self.dp_size), key=lambda g: (self.load[g], g))
        return min(range(self.dp_size), key=lambda g: (self.tokens[g], self.load[g], g))

    def route(self, msg) -> Optional[int]:
        """The DP group `msg` is for (None: all of them)."""
        if not isinstance(msg, protocol.AddRequest):
            return None
        group = msg.dp_rank if msg.dp_rank is not None else self.pick()
        if not 0 <= group < self.dp_size:
            raise ValueError(f"dp_rank {group} out of range for {self.dp_size} DP groups")
        self.dispatched[group] += 1
        self.load[group] += 1
        self.tokens[group] += request_tokens(len(msg.prompt_ids), msg.params.max_new_tokens)
        return group

    def merge_stats(self, per_group: list[protocol.EngineStats]) -> protocol.EngineStats:
        """One EngineStats for the job: sums (hit rate: the mean), with the per-group counters."""
        self.load = [s.running + s.waiting for s in per_group]
        self.tokens = [load_tokens(s) for s in per_group]
        first = per_group[0]
        total = {f: sum(getattr(s, f) for s in per_group)
                 for f in ("running", "waiting", "kv_total_tokens", "kv_free_tokens", "kv_evictable_tokens",
                           "waiting_tokens", "prefix_cache_tokens", "retracted_requests", "spec_plain_steps",
                           "two_batch_forwards")}
        rate = sum(s.prefix_cache_hit_rate for s in per_group) / len(per_group)
        hists = [s.spec_accept_hist for s in per_group if s.spec_accept_hist]
        accept = tuple(map(sum, zip(*hists))) if hists else ()  # every group has the same buckets
        paths = {}
        for s in per_group:
            for path, n in s.forward_paths.items():
                paths[path] = paths.get(path, 0) + n
        return replace(first, **total, prefix_cache_hit_rate=rate, dp_requests=tuple(self.dispatched),
                       forward_paths=paths,
                       dp_running=tuple(self.load),
                       dp_kv_used_tokens=tuple(s.kv_total_tokens - s.kv_free_tokens for s in per_group),
                       dp_kv_load_tokens=tuple(self.tokens),
                       step_seconds=merge([s.step_seconds for s in per_group]), spec_accept_hist=accept)
