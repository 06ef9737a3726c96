"""The messages the serving process and the engine process exchange (plain picklable dataclasses).

Serving -> engine: AddRequest, AbortRequest, Shutdown.
Engine -> serving: EngineInfo (once, when the model is loaded), StepOutputs (after
every scheduler step: the new tokens of each request that moved, plus EngineStats),
AddFailed (a request the scheduler refused), EngineFailed (startup failure or crash).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from engine.sampling import SamplingParams


# ---- serving -> engine -----------------------------------------------------
@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Shutdown:
    """Abort everything still running and exit."""


# ---- engine -> serving -----------------------------------------------------
@dataclass
class EngineInfo:
    max_model_len: int
    vocab_size: int
    kv_total_tokens: int
    max_running_requests: int
    pid: int


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_total_tokens: int = 0
    kv_free_tokens: int = 0
    prefix_cache_tokens: int = 0  # KV tokens held (evictable) by the prefix cache
    prefix_cache_hit_rate: float = 0.0


@dataclass
class RequestOutput:
    """What one request gained in one step (token deltas; prompt log-probs once)."""

    rid: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None
    prompt_top_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None  # stop | length | abort
    matched_stop: Union[int, str, None] = None
    stop_text: Optional[str] = None  # the whole output text, cut before a matched stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass
class AddFailed:
    rid: str
    message: str
    user_error: bool  # True: the request was bad (400); False: an engine bug (500)


@dataclass
class EngineFailed:
    message: str
