"""Order of waiting requests: first come first served, or longest cached prefix first.

'lpm' sorts the queue (stably) by how many of each request's tokens the radix
cache already holds, so requests that share a cached prefix run while it is
still cached. Matching every waiting request costs host time, so beyond
LPM_MAX_QUEUE waiting requests the step falls back to arrival order.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from engine.memory.radix_cache import RadixCache
from engine.scheduler.request import Request

POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128


def order_waiting(waiting: deque[Request], policy: str, cache: Optional[RadixCache]) -> None:
    """Reorder `waiting` in place for this step's admission."""
    if policy != "lpm" or cache is None or len(waiting) < 2 or len(waiting) > LPM_MAX_QUEUE:
        return
    def matched(req: Request) -> int:
        ids = req.token_ids
        return 0 if req.wants_prompt_logprobs else cache.match_length(ids, len(ids) - 1)
    ordered = sorted(waiting, key=matched, reverse=True)
    waiting.clear()
    waiting.extend(ordered)
