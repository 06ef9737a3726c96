"""Two-batch overlap (--enable-two-batch-overlap): one forward's batch run as two micro-batches, so that the
collectives of one hide behind the other's compute.

A layer's forward is written as steps (`comm.Stages`, engine/distributed/comm.py): it yields each collective
it starts (DP attention's gather before the MoE, the MoE's all-reduce, the all-to-all's dispatch and combine).
Run alone (`comm.finish`) each collective is waited for where it is started, as before. Under two-batch overlap
the collectives are started asynchronously and `interleave` alternates the micro-batches at every yield:

    micro-batch 0:  attention ─ gather ┐               ┌ experts ─ all-reduce ┐               ┌ next layer ...
    micro-batch 1:                     └ attention ─ gather ┘                 └ experts ─ all-reduce ┘

so micro-batch 1's attention runs while micro-batch 0's gather is in flight, 0's experts while 1's gather is,
and so on. Every rank runs the same steps in the same order, so the collectives pair up. The price: each
micro-batch reads the layer's weights again (MoE experts included), so it pays only where the collectives
cost more than a second pass over the weights: large batches on several GPUs.

The split (`split_point`): a decode batch after its first ceil(B / 2) requests (a CUDA graph's padded batch
likewise, so the shapes stay static), an extend batch at the request boundary nearest half its tokens; other
forwards (speculative verify and draft forwards, the MTP layer's) are not split. A forward splits when both
micro-batches hold tokens and the whole forward (every DP group's tokens) holds at least `min_tokens`. Under DP
attention each group offers its split in the per-forward agreement (engine/distributed/dp_attention.py), so
every rank knows every group's micro-batches and each micro-batch gathers on its own.

`ForwardContext.begin_forward` (engine/model/context.py) plans the micro-batches (each with its own attention
planning and context); `DeepseekForCausalLM.hidden_states` runs them.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Optional

from engine.distributed.comm import Stages
from engine.forward_batch import ForwardBatch, ForwardMode

SPLIT_MODES = (ForwardMode.DECODE, ForwardMode.EXTEND)


@dataclass(frozen=True)
class TwoBatchOverlap:
    """The flags' rule: split a forward of at least `min_tokens` tokens (over every DP group)."""

    min_tokens: int

    def splits(self, first: int, total: int) -> bool:
        """Whether a forward of `total` tokens, `first` of them in its first micro-batch, runs as two."""
        return 0 < first < total and total >= self.min_tokens


def split_point(fb: ForwardBatch) -> tuple[int, int]:
    """(requests, tokens) of fb's first micro-batch; (0, 0) for a forward that is not split (an MTP forward, a
    speculative verify, an idle batch, one request)."""
    if fb.mode not in SPLIT_MODES or fb.spec_hidden is not None or fb.batch_size < 2:
        return 0, 0
    if fb.mode is ForwardMode.DECODE:
        r = (fb.batch_size + 1) // 2
        return r, r
    ends = list(itertools.accumulate(fb.extend_lens_cpu))
    half = ends[-1] / 2
    r = min(range(1, fb.batch_size), key=lambda i: abs(ends[i - 1] - half))
    return r, ends[r - 1]


def requests_before(fb: ForwardBatch, tokens: int) -> int:
    """How many of fb's requests hold its first `tokens` tokens (a request boundary: DP attention's agreed
    split of this group's batch)."""
    if tokens == 0:
        return 0
    ends = list(itertools.accumulate(fb.extend_lens_cpu))
    r = bisect.bisect_left(ends, tokens)
    if r >= len(ends) or ends[r] != tokens:
        raise ValueError(f"{tokens} tokens do not end a request of this batch")
    return r + 1


def slice_batch(fb: ForwardBatch, r0: int, r1: int, t0: int, t1: int) -> ForwardBatch:
    """Requests [r0, r1) of fb, holding its tokens [t0, t1), as a batch of their own (views of fb's tensors). Its
    logits rows are empty: logits are taken from the whole batch's hidden states."""
    real = None if fb.real_tokens is None else min(max(fb.real_tokens - t0, 0), t1 - t0)
    return ForwardBatch(
        mode=fb.mode if t1 > t0 else ForwardMode.IDLE, input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
        req_pool_indices=fb.req_pool_indices[r0:r1], seq_lens=fb.seq_lens[r0:r1],
        out_cache_loc=fb.out_cache_loc[t0:t1], extend_lens=fb.extend_lens[r0:r1], prefix_lens=fb.prefix_lens[r0:r1],
        logits_indices=fb.logits_indices[:0], seq_lens_cpu=fb.seq_lens_cpu[r0:r1],
        extend_lens_cpu=fb.extend_lens_cpu[r0:r1], prefix_lens_cpu=fb.prefix_lens_cpu[r0:r1],
        req_rows_cpu=None if fb.req_rows_cpu is None else fb.req_rows_cpu[r0:r1], real_tokens=real,
    )


def split_batch(fb: ForwardBatch, requests: int, tokens: int) -> tuple[ForwardBatch, ForwardBatch]:
    """fb as its first `requests` requests (its first `tokens` tokens) and the rest."""
    return (slice_batch(fb, 0, requests, 0, tokens),
            slice_batch(fb, requests, fb.batch_size, tokens, fb.num_tokens))


def interleave(first: Stages, second: Stages) -> tuple[Any, Any]:
    """Run two micro-batches' steps alternately: each runs until it has started a collective, then the other
    does, and each waits for its collective only when its turn comes again. Returns both results."""
    steps = [first, second]
    pending: list[Optional[Any]] = [None, None]
    results: list[Any] = [None, None]
    live = [True, True]
    turn = 0
    while any(live):
        if live[turn]:
            value = pending[turn].wait() if pending[turn] is not None else None
            try:
                pending[turn] = steps[turn].send(value)
            except StopIteration as done:
                results[turn], live[turn] = done.value, False
        turn ^= 1
    return results[0], results[1]
