"""One generation request and its state while it is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.sampling import SamplingParams


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: Optional[torch.Generator] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[float]]] = None
    finish_reason: Optional[str] = None  # stop | length | abort
    matched_stop: Optional[object] = None  # the stop string or token id that ended it
    text: str = ""  # decoded output (cut before a matched stop string)
    # KV memory: the request-table row and the slots of its cached tokens, in order.
    row: Optional[int] = None
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cached(self) -> int:
        return int(self.slots.numel())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
