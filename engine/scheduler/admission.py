"""The admission check's reservation: how much KV the admitted requests will still want.

A waiting request is admitted when the KV pool (free slots plus what the radix
cache could evict) holds its uncached tokens plus a reservation for everything
already admitted: at least one slot each for the next decode step, and `ratio`
of the tokens each may still generate (max_new_tokens left, at most
CLIP_NEW_TOKENS), the candidate's own included. Most requests stop well before
max_new_tokens, so the ratio starts at INIT_RATIO and decays by DECAY per decode
step down to MIN_RATIO; a retraction shows that it was too low, so each one
raises it again (to at least INIT_RATIO, plus RETRACT_STEP, at most 1).

A request with nothing else admitted needs only room for its tokens: a lone
request always makes progress (the prompt check guarantees its prompt fits the
pool). When the estimate still falls short, decode runs out of slots and the
newest requests are retracted (scheduler.py): the reservation makes that rare,
retraction makes it safe.
"""

from __future__ import annotations

from typing import Iterable

from engine.scheduler.request import Request

INIT_RATIO = 0.7
MIN_RATIO = 0.1
DECAY = 0.001  # per decode step: from INIT_RATIO to MIN_RATIO in 600 steps
RETRACT_STEP = 0.1
CLIP_NEW_TOKENS = 4096  # a larger max_new_tokens counts as this much


class Reservation:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.ratio = INIT_RATIO

    def future(self, req: Request) -> int:
        """The slots set aside for the tokens req may still generate."""
        done = req.num_output + req.pending
        left = min(req.params.max_new_tokens - done, self.max_model_len - len(req.token_ids) - req.pending,
                   CLIP_NEW_TOKENS)
        return int(max(left, 0) * self.ratio)

    def total(self, reqs: Iterable[Request]) -> int:
        """The reservation of all unfinished reqs (one pass, no per-request calls: it runs over the batch)."""
        context, left_sum = self.max_model_len, 0
        for r in reqs:
            if r.finish_reason is None:
                n = len(r.token_ids) + r.pending
                left = min(r.params.max_new_tokens - (n - r.prompt_len), context - n, CLIP_NEW_TOKENS)
                if left > 0:
                    left_sum += left
        return int(left_sum * self.ratio)

    def decode_step(self) -> None:
        self.ratio = max(MIN_RATIO, self.ratio - DECAY)

    def retracted(self) -> None:
        self.ratio = min(1.0, max(self.ratio, INIT_RATIO) + RETRACT_STEP)
