"""What leaves the scheduler: per-request deltas (`RequestOutput`), and their reassembly (`CollectedOutput`).

The output processor (engine/scheduler/processor.py) makes one `RequestOutput`
per request that moved since the deltas were last taken: the new tokens with
their log-probs, the prompt log-probs once, and the finish. Both consumers read
the same deltas: the server's engine loop sends them to the serving process,
whose `Sequence` is a `CollectedOutput`; the offline `Engine` collects them into
`CollectedOutput`s and turns those into `GenerateOutput`s. Plain picklable
dataclasses (they cross the pipe between the two server processes).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Optional, Union


@dataclass
class RequestOutput:
    """What one request gained since the last delta (token deltas; prompt log-probs once)."""

    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Optional[list[float]] = None  # set when the request asked for log-probs
    new_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None  # stop | length | abort | error
    matched_stop: Union[int, str, None] = None
    stop_text: Optional[str] = None  # the whole output text, cut before a matched stop string
    error: Optional[str] = None  # with finish_reason "error": what failed (the step's exception)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CollectedOutput:
    """A request's output put back together from its deltas."""

    _: KW_ONLY
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    matched_stop: object = None
    stop_text: Optional[str] = None
    error: Optional[str] = None
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: RequestOutput) -> None:
        self.cached_tokens = out.cached_tokens
        self.output_ids += out.new_token_ids
        if out.new_logprobs is not None:
            self.logprobs += out.new_logprobs
        if out.new_top_logprobs is not None:
            self.top_logprobs += out.new_top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
        if out.finished:
            self.finish_reason, self.matched_stop, self.stop_text = out.finish_reason, out.matched_stop, out.stop_text
            self.error = out.error

    def stopped_by_token(self) -> bool:
        """Ended by EOS or a stop token id: that last token is not part of the text."""
        return self.finish_reason == "stop" and isinstance(self.matched_stop, int) and bool(self.output_ids)

    def visible_ids(self) -> list[int]:
        """The output ids whose text is shown (without a final EOS / stop token)."""
        return self.output_ids[:-1] if self.stopped_by_token() else self.output_ids
