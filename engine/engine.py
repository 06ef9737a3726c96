"""Engine: the offline API. Batched generation over the scheduler and model runner.

    from engine.engine import Engine
    from engine.sampling import SamplingParams
    eng = Engine(model="tiny")
    outs = eng.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_new_tokens=16))

The server, `bench` and tests all drive the model through this class.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from engine.args import EngineArgs
from engine.errors import RequestError, UsageError
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler
from engine.tokenizer import load_tokenizer


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_logprobs: Optional[list[Optional[float]]] = None
    matched_stop: Optional[object] = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Engine:
    def __init__(self, args: Optional[EngineArgs] = None, **overrides):
        args = (args or EngineArgs()).replace(**overrides) if overrides else (args or EngineArgs())
        self.args = args.validate()
        torch.manual_seed(args.seed)
        self.runner = ModelRunner(args)
        self.tokenizer = load_tokenizer(self.runner.resolved.path)
        eos = self.tokenizer.eos_ids() if self.tokenizer else set()
        if not eos and self.runner.config.eos_token_id is not None:
            eos = {self.runner.config.eos_token_id}
        self.scheduler = Scheduler(
            self.runner, self._decode, eos, max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size, enable_radix_cache=not args.disable_radix_cache,
            schedule_policy=args.schedule_policy, enable_overlap=not args.disable_overlap_schedule)
        self._ids = itertools.count()

    @property
    def config(self):
        return self.runner.config

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special) if self.tokenizer else ""

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.args.model} has no tokenizer files here; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        params.validate()
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        return Request(rid=str(next(self._ids)), prompt_ids=list(prompt_ids), params=params, generator=gen)

    def generate(
        self,
        prompts: Union[str, Sequence[str], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> list[GenerateOutput]:
        """Generate for several prompts batched together; results in input order."""
        if (prompts is None) == (input_ids is None):
            raise RequestError("give exactly one of prompts or input_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = [self.encode(p) for p in prompts] if prompts is not None else [list(x) for x in input_ids]
        params = _per_prompt(sampling_params, len(token_lists))
        reqs = [self.make_request(ids, p) for ids, p in zip(token_lists, params)]
        for req in reqs:
            self.scheduler.add(req)
        self.run_until_done(reqs)
        return [self.output_of(r) for r in reqs]

    def run_until_done(self, reqs: Iterable[Request]) -> None:
        reqs = list(reqs)
        while not all(r.finished for r in reqs):
            if not self.scheduler.has_work():
                raise RuntimeError("scheduler went idle with unfinished requests")
            self.scheduler.step()

    def output_of(self, req: Request) -> GenerateOutput:
        text = req.text if req.matched_stop is not None and isinstance(req.matched_stop, str) else \
            self._decode(self._visible_ids(req), req.params.skip_special_tokens)
        p = req.params
        return GenerateOutput(
            text=text,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason,
            prompt_token_ids=list(req.prompt_ids),
            logprobs=list(req.output_logprobs) if p.logprobs or p.top_logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if p.top_logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
            matched_stop=req.matched_stop,
        )

    def _visible_ids(self, req: Request) -> list[int]:
        """Output ids without a final EOS / stop token (which is not part of the text)."""
        if req.finish_reason == "stop" and isinstance(req.matched_stop, int):
            return req.output_ids[:-1]
        return req.output_ids


def _per_prompt(sp, n: int) -> list[SamplingParams]:
    import copy

    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [copy.deepcopy(sp) for _ in range(n)]
    if len(sp) != n:
        raise RequestError(f"{len(sp)} sampling params for {n} prompts")
    return [copy.deepcopy(p) for p in sp]
