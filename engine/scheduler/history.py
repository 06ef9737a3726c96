"""The sampler's `History` of one step's requests: what penalties and min_tokens read besides the params.

A request's tokens on the host lag by the step in flight under overlap scheduling: that token is read
from the previous step's sampled-token tensor on the device (`in_flight`), as the decode inputs are.
Built only when some request of the step has penalties or min_tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.forward_batch import to_device
from engine.sampling import History
from engine.scheduler.request import Request


def tokens_in_flight(reqs: list[Request], previous: torch.Tensor, fallback) -> torch.Tensor:
    """Per request, its token sampled by the step in flight (read from that step's tokens `previous` on the
    device, without waiting), else `fallback` (a tensor of the same length, or a number)."""
    src = to_device([r.pending_row if r.pending else -1 for r in reqs], previous.device)  # not blocking
    return torch.where(src >= 0, previous[src.clamp(min=0)], fallback)


def sampling_history(reqs: list[Request], eos_ids: set[int], previous: Optional[torch.Tensor],
                     device: torch.device) -> Optional[History]:
    """History for reqs (rows of the step), or None when no request needs one; `previous` holds the sampled
    tokens of the step in flight (None: none)."""
    if not any(r.params.needs_history for r in reqs):
        return None
    in_flight = None
    if previous is not None and any(r.pending for r in reqs):
        in_flight = tokens_in_flight(reqs, previous, -1).to(device)
    return History(token_ids=[r.token_ids for r in reqs], prompt_lens=[r.prompt_len for r in reqs],
                   pending=[r.pending for r in reqs], in_flight=in_flight, eos_ids=tuple(sorted(eos_ids)))
