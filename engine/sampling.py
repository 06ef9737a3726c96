"""Sampling parameters and token sampling: greedy, temperature, top-k, top-p, min-p, seeded.

Each request with a seed samples from its own torch.Generator, so its output does
not depend on which other requests share the batch. Log-probabilities are those
of the model's raw distribution (before temperature and truncation).

`sample_async` leaves its results on the device (the overlap scheduler feeds the sampled
tokens straight into the next decode step); `PendingSample.start_copy()` queues the
device->host copies right after the step with a CUDA event, so `resolve()` waits only for
that step, not for the next one already queued behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.errors import RequestError


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # per output token log-prob of the chosen token
    top_logprobs: int = 0  # also the n most likely alternatives at each step
    prompt_logprobs: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> "SamplingParams":
        checks = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0 (got {self.max_new_tokens})"),
            (self.temperature >= 0 and math.isfinite(self.temperature),
             f"temperature must be a finite number >= 0 (got {self.temperature})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (self.top_k >= -1, f"top_k must be -1 (disabled) or >= 0 (got {self.top_k})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (0 <= self.top_logprobs <= 20, f"top_logprobs must be in [0, 20] (got {self.top_logprobs})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # log-prob of each chosen token under the raw distribution
    top: list[list[tuple[int, float]]]  # per row: top alternatives (empty unless asked)


def _truncate(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Zero out tokens removed by top-k / top-p / min-p (probs is one row, float32)."""
    if p.top_k > 0 and p.top_k < probs.numel():
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


@dataclass
class PendingSample:
    tokens: torch.Tensor  # [N] int64 on the logits' device (the next step may read them there)
    logprobs: torch.Tensor  # [N] float32
    top: list[Optional[tuple[torch.Tensor, torch.Tensor]]]  # per row: (ids, log-probs), or None
    host: Optional[tuple] = None
    ready: Optional[object] = None  # torch.cuda.Event

    def start_copy(self) -> "PendingSample":
        if self.tokens.device.type != "cuda":
            self.host = (self.tokens, self.logprobs, self.top)
            return self
        cpu = lambda t: t.to("cpu", non_blocking=True)  # noqa: E731
        self.host = (cpu(self.tokens), cpu(self.logprobs),
                     [None if t is None else (cpu(t[0]), cpu(t[1])) for t in self.top])
        self.ready = torch.cuda.Event()
        self.ready.record()
        return self

    def resolve(self) -> SampleResult:
        if self.host is None:
            self.start_copy()
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs, top = self.host
        return SampleResult(tokens=tokens.tolist(), logprobs=logprobs.tolist(),
                            top=[[] if t is None else list(zip(t[0].tolist(), t[1].tolist())) for t in top])


def sample_async(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[Optional[torch.Generator]]) -> PendingSample:
    """One token per row of logits [N, V]; results stay on the device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _truncate(torch.softmax(logits[i].float() / p.temperature, dim=-1), p)
        g = generators[i]
        if g is not None and g.device.type == "cpu":
            tok = torch.multinomial(probs.cpu(), 1, generator=g).to(tokens.device)
        else:
            tok = torch.multinomial(probs, 1, generator=g)
        tokens[i] = tok[0]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top = []
    for i, p in enumerate(params):
        if p.top_logprobs:
            v, ix = logp[i].topk(p.top_logprobs)
            top.append((ix, v))
        else:
            top.append(None)
    return PendingSample(tokens=tokens, logprobs=chosen, top=top)
