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
    # KV memory: the request-table row and the slots reserved for its tokens, in order.
    # slots[:kv_len] hold computed (or launched) KV; slots[:prefix_len] belong to the radix
    # cache and are locked through `last_node`; the rest belong to the request.
    row: Optional[int] = None
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Optional[object] = None
    # Prompt tokens whose KV came from the prefix cache at (first) admission.
    cached_tokens: int = 0
    admitted: int = 0  # times admitted (more than once after a retraction)
    retracted: int = 0
    # Overlap scheduling: tokens sampled on the device but not yet appended to output_ids,
    # and the row of the newest one in that step's sampled-token tensor.
    pending: int = 0
    pending_row: int = -1
    # Prompt log-probs gathered chunk by chunk during a chunked prefill.
    prompt_lp_partial: list[float] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cached(self) -> int:
        """Tokens whose KV is computed (or being computed by the step in flight)."""
        return self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return bool(self.params.prompt_logprobs) and self.prompt_logprobs is None
