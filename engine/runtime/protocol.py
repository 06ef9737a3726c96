"""The messages the serving process and the engine process exchange (plain picklable dataclasses).

Serving -> engine: AddRequest, AbortRequest, Shutdown, ReportExpertLoad, StartProfile, StopProfile.
Engine -> serving: EngineInfo (once, when the model is loaded), StepOutputs (after
every scheduler step: the new tokens of each request that moved, plus EngineStats),
AddFailed (a request the scheduler refused), EngineFailed (startup failure or crash), ExpertLoadUpdate and
ProfileWritten (answers).
`RequestOutput`, the per-request delta, is the engine's own (engine/scheduler/output.py):
the offline Engine consumes the same deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.grammar.spec import GrammarSpec
from engine.model.expert_load import ExpertLoadReport
from engine.sampling import SamplingParams
from engine.scheduler.output import RequestOutput


# ---- serving -> engine -----------------------------------------------------
@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    dp_rank: Optional[int] = None  # DP attention: run on this DP group (None: the controller's policy picks)
    grammar: Optional[GrammarSpec] = None  # constrain the output (engine/grammar)


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Shutdown:
    """Abort everything still running and exit."""


@dataclass
class ReportExpertLoad:
    """Send the routing counts (--record-expert-load): every rank sums its counts with the others', rank 0
    answers with an ExpertLoadUpdate."""


@dataclass
class StartProfile:
    """Every rank starts torch.profiler (engine/runtime/profiling.py); `stamp` names the files of this profile,
    which stops by itself after `max_steps` engine steps (0: at StopProfile)."""

    stamp: str
    max_steps: int = 0


@dataclass
class StopProfile:
    """Every rank stops its profile and writes its trace; rank 0 answers with a ProfileWritten. `ran_its_steps`:
    sent by rank 0 itself when the profile reached its max_steps."""

    ran_its_steps: bool = False


# ---- engine -> serving -----------------------------------------------------
@dataclass
class ProfileWritten:
    """Each rank's profile summary (engine/runtime/profiling.py CommSummary, as dicts), rank order; sent at a
    StopProfile, or by itself when the profile ran its steps (`stamp`: which profile)."""

    stamp: str
    ranks: list[dict]
    ran_its_steps: bool = False  # stopped by itself (max_steps), not by a StopProfile from the serving process


@dataclass
class ExpertLoadUpdate:
    """The job's routing counts since it became ready (None: --record-expert-load is off); sent on request and
    every EXPERT_LOAD_EVERY step outputs."""

    report: Optional[ExpertLoadReport]


@dataclass
class EngineInfo:
    max_model_len: int
    vocab_size: int
    kv_total_tokens: int
    max_running_requests: int
    pid: int
    dp_kv_tokens: tuple[int, ...] = ()  # DP attention: each DP group's KV pool (kv_total_tokens is their sum)

    @property
    def request_kv_tokens(self) -> int:
        """The KV tokens one request can use: its DP group's pool (the whole pool without DP attention)."""
        return min(self.dp_kv_tokens) if self.dp_kv_tokens else self.kv_total_tokens


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_total_tokens: int = 0
    kv_free_tokens: int = 0
    kv_evictable_tokens: int = 0  # of the slots in use, those the prefix cache could free (no request holds them)
    waiting_tokens: int = 0  # DP attention: KV the waiting requests will take (dp_controller.waiting_tokens)
    prefix_cache_tokens: int = 0  # KV tokens held (evictable) by the prefix cache
    prefix_cache_hit_rate: float = 0.0
    retracted_requests: int = 0  # cumulative: requests preempted when decode ran out of KV (resumed later)
    dp_requests: tuple[int, ...] = ()  # DP attention, cumulative: requests dispatched to each DP group
    dp_running: tuple[int, ...] = ()  # DP attention: running + waiting requests of each DP group
    dp_kv_used_tokens: tuple[int, ...] = ()  # DP attention: KV slots in use in each DP group (total - free)
    dp_kv_load_tokens: tuple[int, ...] = ()  # DP attention: each group's load as total_tokens weighs it
    # speculative decoding, cumulative: request-steps that emitted 1, 2, ... tokens (empty when off)
    spec_accept_hist: tuple[int, ...] = ()
    spec_plain_steps: int = 0  # cumulative: decode steps run without speculation (--speculative-disable-by-batch-size)
    two_batch_forwards: int = 0  # cumulative: forwards run as two micro-batches (--enable-two-batch-overlap)
    forward_paths: dict = field(default_factory=dict)  # cumulative: forwards per path (cuda_graph, piecewise, eager)
    # cumulative, per step kind: (per-bucket counts of engine.scheduler.step_times.BUCKETS and +Inf, seconds)
    step_seconds: dict = field(default_factory=dict)


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
