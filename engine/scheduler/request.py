"""One generation request and its state while it is scheduled.

Token storage is one growing list: `token_ids` holds the prompt followed by every
generated token, and is only ever appended to (O(1) per token). The prompt is
`token_ids[:prompt_len]`; `num_output` counts generated tokens without building a
list. Log-probs and text are not kept here: they leave as deltas
(engine/scheduler/output.py) when the output processor appends a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.grammar.matcher import RequestGrammar
from engine.sampling import SamplingParams


@dataclass
class Request:
    rid: str
    token_ids: list[int]  # the prompt, then each generated token
    prompt_len: int
    params: SamplingParams
    generator: Optional[torch.Generator] = None
    finish_reason: Optional[str] = None  # stop | length | abort | error
    matched_stop: Optional[object] = None  # the stop string or token id that ended it
    # KV memory: the request-table row and the slots reserved for its tokens, in order: `slots`
    # (a host tensor, set at admission and after the prefill) then `decode_slots` (one per decode
    # step, appended in O(1); RequestMemory.slots_of joins them). Of those, the first kv_len hold
    # computed (or launched) KV; the first prefix_len belong to the radix cache and are locked
    # through `last_node`; the rest belong to the request.
    row: Optional[int] = None
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    decode_slots: list[int] = field(default_factory=list)
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Optional[object] = None
    # Prompt tokens whose KV came from the prefix cache at (first) admission.
    cached_tokens: int = 0
    admitted: int = 0  # times admitted (more than once after a retraction)
    retracted: int = 0
    # Overlap scheduling: tokens sampled on the device but not yet appended to token_ids,
    # and the row of the newest one in that step's sampled-token tensor.
    pending: int = 0
    pending_row: int = -1
    # Prompt log-probs: gathered chunk by chunk during a chunked prefill, done after the last chunk.
    prompt_lp_partial: list[float] = field(default_factory=list)
    prompt_lp_done: bool = False
    # Incremental stop-string matching (engine/scheduler/stops.py), made on the first token.
    stop_matcher: Optional[object] = None
    # Speculative decoding: draft-KV progress and pending target hidden states (engine/speculative/decoder.py).
    spec: Optional[object] = None
    # Grammar-constrained output (engine/grammar/matcher.py): the request's matcher, or None.
    grammar: Optional[RequestGrammar] = None

    @classmethod
    def new(cls, rid: str, prompt_ids: list[int], params: SamplingParams,
            generator: Optional[torch.Generator] = None) -> "Request":
        return cls(rid=rid, token_ids=list(prompt_ids), prompt_len=len(prompt_ids), params=params,
                   generator=generator)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy: use `num_output` for the count)."""
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return bool(self.params.prompt_logprobs) and not self.prompt_lp_done
