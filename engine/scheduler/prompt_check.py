"""The one check of a prompt against the engine's limits, shared by `Scheduler.add` and the server.

A prompt is refused when it is empty, leaves no room in the context for one
generated token, needs more KV slots than the pool has, or holds token ids
outside the vocabulary. The server calls it first (a 400 naming the parameter,
with `code` as the OpenAI error code); the scheduler calls it again for requests
that do not come through the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from engine.errors import RequestError


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int  # prompt + output tokens
    vocab_size: int
    kv_tokens: int  # size of the KV pool


class PromptError(RequestError):
    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code  # "context_length_exceeded", or None


def check_prompt(ids: Sequence[int], limits: PromptLimits) -> None:
    """Raise PromptError when the engine cannot serve this prompt."""
    n = len(ids)
    if n == 0:
        raise PromptError("the prompt is empty")
    if n >= limits.max_model_len:
        raise PromptError(f"this model's maximum context length is {limits.max_model_len} tokens, but the prompt "
                          f"has {n} tokens (and at least one token must be generated)", "context_length_exceeded")
    if n > limits.kv_tokens:
        raise PromptError(f"the prompt has {n} tokens but the KV cache holds only {limits.kv_tokens}",
                          "context_length_exceeded")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise PromptError(f"token id(s) {bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
