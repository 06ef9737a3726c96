"""Sampling that leaves its results on the device, for the overlap scheduler.

`sample_async` makes the same choices as `engine.sampling.sample` (same ops in
the same order, so seeded and unseeded random streams match), but returns a
`PendingSample` holding device tensors. `start_copy()` queues the device->host
copies right after the step (recording a CUDA event), so that `resolve()` later
waits only for this step, not for the next step already queued behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.sampling import SampleResult, SamplingParams, _truncate


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
