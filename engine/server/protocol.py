"""The messages the serving process and the engine process exchange (plain picklable dataclasses).

Serving -> engine: AddRequest, AbortRequest, Shutdown.
Engine -> serving: EngineInfo (once, when the model is loaded), StepOutputs (after
every scheduler step: the new tokens of each request that moved, plus EngineStats),
AddFailed (a request the scheduler refused), EngineFailed (startup failure or crash).
`RequestOutput`, the per-request delta, is the engine's own (engine/scheduler/output.py):
the offline Engine consumes the same deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling import SamplingParams
from engine.scheduler.output import RequestOutput


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
    retracted_requests: int = 0  # cumulative: requests preempted when decode ran out of KV (resumed later)


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
