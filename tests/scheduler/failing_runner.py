"""A ModelRunner stand-in for fault tests: delegates to a real runner, but `forward` raises when told to.

Before raising it writes random values over the KV slots the forward would have
filled, as a step that dies half-way may, so a scheduler that wrongly keeps (or
caches) that KV produces different tokens later and the tests see it.
The server tests use it inside the spawned engine process (`make_engine`).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.forward_batch import ForwardBatch, ForwardMode

POISON = 319  # a token id of the tiny model (vocab 320) that the tests' random prompts (ids < 256) never hold


class InjectedFailure(RuntimeError):
    pass


class FailingRunner:
    def __init__(self, runner, when: Callable[[ForwardBatch], bool]):
        self.runner, self.when = runner, when
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, fb: ForwardBatch):
        if self.when(fb):
            self.failures += 1
            pool = self.runner.kv_pool
            loc = fb.out_cache_loc.to(pool.device)
            for buf in pool.buffer:
                buf[loc] = torch.randn(loc.numel(), pool.dim).to(pool.dtype)
            raise InjectedFailure(f"injected failure #{self.failures} ({fb.mode.value}, {fb.batch_size} requests)")
        return self.runner.forward(fb)


def poisoned_prefill(fb: ForwardBatch) -> bool:
    """Fail every prefill of a prompt that starts with POISON (the model may generate POISON, but a generated
    token is never the first of a sequence, so a retracted request's recompute never trips it)."""
    if fb.mode is not ForwardMode.EXTEND:
        return False
    ids, start = fb.input_ids.tolist(), 0
    for prefix, n in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu):
        if prefix == 0 and n and ids[start] == POISON:
            return True
        start += n
    return False


class NthDecode:
    """Fail the n-th decode forward (counting from 1)."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def __call__(self, fb: ForwardBatch) -> bool:
        if fb.mode.is_decode:
            self.seen += 1
            return self.seen == self.n
        return False


def make_poisoned_engine(args, local_rank=None):
    """An Engine whose scheduler runs over FailingRunner(poisoned_prefill) (engine_main's `make_engine`)."""
    from engine.engine import Engine

    engine = Engine(args, local_rank=local_rank)
    use_runner(engine, FailingRunner(engine.runner, poisoned_prefill))
    return engine


def use_runner(engine, runner, **flags):
    """Give `engine` a fresh scheduler (flags as Engine.make_scheduler's) that launches its forwards on `runner`."""
    from engine.scheduler.processor import OutputProcessor
    from engine.scheduler.scheduler import Scheduler

    args = engine.args.replace(**flags)
    outputs = OutputProcessor(engine.tokenizer, engine.eos_ids, engine.runner.max_model_len)
    engine.scheduler = Scheduler(runner, outputs, args.scheduler, radix_cache=not args.cache.disable_radix_cache,
                                 attention_groups=args.attention_groups())
    return engine.scheduler
