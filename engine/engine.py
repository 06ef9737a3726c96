"""Engine: the offline API. Batched generation over the scheduler and model runner.

    from engine.engine import Engine
    from engine.sampling import SamplingParams
    eng = Engine(model="tiny")
    outs = eng.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_new_tokens=16))

`generate` queues the requests, steps the scheduler until they finish, and builds
each `GenerateOutput` from the same per-request deltas (`RequestOutput`, taken from
the scheduler's output processor) that the server's engine loop streams. The
server, `bench` and tests all drive the model through this class.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from engine.args import EngineArgs
from engine.checkpoint.tokenizer import load_tokenizer
from engine.distributed.groups import init_parallel
from engine.errors import RequestError, UsageError
from engine.grammar.compiler import GrammarCompiler, check
from engine.grammar.matcher import GrammarMasks, RequestGrammar
from engine.grammar.spec import GrammarSpec
from engine.runner.device import pick_device
from engine.runner.model_runner import ModelRunner, timed
from engine.sampling import SamplingParams
from engine.scheduler.output import CollectedOutput
from engine.scheduler.processor import OutputProcessor
from engine.scheduler.request import Request
from engine.scheduler.scheduler import Scheduler
from engine.speculative.decoder import SpecDecoder
from engine.speculative.draft_runner import DraftRunner


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
    error: Optional[str] = None  # finish_reason "error": the failed step's message

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Engine:
    def __init__(self, args: Optional[EngineArgs] = None, local_rank: Optional[int] = None, **overrides):
        """One engine over one model (flags: `args` and/or flag-name `overrides`).

        With --tp N > 1 this is one rank of N: an engine rank process (engine/runtime/rank_loop.py)
        passes its `local_rank` and this joins the torch.distributed world. To drive N ranks from one
        process, use `engine.runtime.offline.open_engine` (dsctl generate does)."""
        args = (args or EngineArgs()).replace(**overrides)
        self.args = args.validate()
        torch.manual_seed(args.model.seed)
        draft = DraftRunner if args.speculative.enabled else None
        self.startup: dict[str, float] = {}  # seconds per start-up phase, for the logs
        with timed(self.startup, "joining the world"):
            parallel = self._join_world(local_rank)
        with timed(self.startup, "runner"):
            self.runner = ModelRunner(args, parallel=parallel, draft=draft)
        with timed(self.startup, "tokenizer and scheduler"):
            self.tokenizer = load_tokenizer(self.runner.resolved.tokenizer_path)
            eos = self.tokenizer.eos_ids() if self.tokenizer else set()
            if not eos and self.runner.config.eos_token_id is not None:
                eos = {self.runner.config.eos_token_id}
            self.eos_ids = eos
            self.grammars: Optional[GrammarCompiler] = None  # made for the first grammar request
            self.scheduler = self.make_scheduler()
        self._ids = itertools.count()

    def _join_world(self, local_rank: Optional[int]):
        pc = self.args.parallel.config()
        if pc.world_size == 1:
            return None
        if local_rank is None:
            raise UsageError(f"--tp {pc.tp_size} runs one process per rank: start them with "
                             "engine.runtime.offline.open_engine(args) (or dsctl generate / serve)")
        return init_parallel(pc, local_rank, pick_device(self.args.model.device).type)

    def make_scheduler(self, **flags) -> Scheduler:
        """A scheduler (and its output processor) over this engine's model; `flags` change scheduling /
        cache flags from this engine's (e.g. disable_radix_cache=True)."""
        args = self.args.replace(**flags)
        outputs = OutputProcessor(self.tokenizer, self.eos_ids, self.runner.max_model_len)
        sched = Scheduler(self.runner, outputs, args.scheduler, radix_cache=not args.cache.disable_radix_cache,
                          attention_groups=args.attention_groups())
        sched.grammar_masks = GrammarMasks(self.runner.config.vocab_size, self.runner.device)
        if args.speculative.enabled:  # (the scheduler then never mixes: running requests decode in spec steps)
            sched.spec = SpecDecoder(self.runner, args.speculative)
        return sched

    @property
    def config(self):
        return self.runner.config

    def _decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special) if self.tokenizer else ""

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.args.model.model} has no tokenizer files here; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def make_request(self, prompt_ids: list[int], params: SamplingParams, rid: Optional[str] = None,
                     grammar: Optional[GrammarSpec] = None) -> Request:
        """A request (not queued yet); `grammar` constrains its output (a GrammarError if it cannot be compiled)."""
        params.validate()
        matcher = self.request_grammar(grammar, prompt_ids) if grammar is not None else None
        if params.adjusts_logits and self.scheduler.spec is not None:
            raise RequestError("frequency_penalty, presence_penalty, repetition_penalty, logit_bias and min_tokens "
                               "are not supported with speculative decoding")
        gen = None
        if params.seed is not None:  # on the host: the sampler draws one number from it per step
            gen = torch.Generator().manual_seed(params.seed)
        req = Request.new(rid if rid is not None else str(next(self._ids)), prompt_ids, params, gen)
        req.grammar = matcher
        return req

    def request_grammar(self, spec: GrammarSpec, prompt_ids: list[int]) -> RequestGrammar:
        """A matcher for spec, compiled for this model's vocabulary (compiled grammars are cached). One process:
        compiled on a background thread (the scheduler admits the request once it is ready; a compile that
        fails fails the request); with several ranks here, at once (the mirrored schedulers must admit it
        at the same step). A spec that does not parse raises GrammarError at once."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer files, so its output cannot be constrained by a grammar")
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.runner.config.vocab_size, self.eos_ids)
        if self.args.parallel.config().world_size > 1:
            compiled = self.grammars.compile(spec)
        else:
            check(spec)
            compiled = self.grammars.submit(spec)
        return RequestGrammar(compiled, spec, self.grammars.reasoning_end, prompt_ids)

    def generate(
        self,
        prompts: Union[str, Sequence[str], None] = None,
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        input_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> list[GenerateOutput]:
        """Generate for several prompts batched together; results in input order."""
        token_lists = prompt_token_lists(prompts, input_ids, self.encode)
        params = per_prompt(sampling_params, len(token_lists))
        reqs = [self.make_request(ids, p) for ids, p in zip(token_lists, params)]
        for req in reqs:
            self.scheduler.add(req)
        return self.run_until_done(reqs)

    def spec_accept_hist(self) -> tuple[int, ...]:
        """Speculative decoding, cumulative: request-steps that emitted 1, 2, ... tokens (empty when off)."""
        return tuple(self.scheduler.stats().get("spec_accept_hist", ()))

    def run_until_done(self, reqs: Iterable[Request]) -> list[GenerateOutput]:
        """Step until every request of reqs finished; their outputs, in order, built from their deltas."""
        reqs = list(reqs)
        collected = {r.rid: CollectedOutput() for r in reqs}
        while True:
            for out in self.scheduler.take_outputs():
                if out.rid in collected:
                    collected[out.rid].add(out)
            if all(r.finished for r in reqs):
                self.scheduler.release_finished()  # as the next step would: their KV cached or freed now
                return [self._output(r, collected[r.rid]) for r in reqs]
            if not self.scheduler.has_work():
                raise RuntimeError("scheduler went idle with unfinished requests")
            self.scheduler.step()

    def _output(self, req: Request, got: CollectedOutput) -> GenerateOutput:
        return build_output(req.prompt_ids, req.params, got, self._decode)

    def close(self) -> None:
        """Stop the runner's background kernel compiles (RankedEngine stops its ranks) and grammar compiles."""
        self.runner.close()
        if self.grammars is not None:
            self.grammars.close()


def build_output(prompt_ids: list[int], p: SamplingParams, got: CollectedOutput, decode) -> GenerateOutput:
    """One request's GenerateOutput from its collected deltas; decode(ids, skip_special) -> text."""
    text = got.stop_text if got.stop_text is not None else decode(got.visible_ids(), p.skip_special_tokens)
    return GenerateOutput(
        text=text,
        token_ids=got.output_ids,
        finish_reason=got.finish_reason,
        prompt_token_ids=prompt_ids,
        logprobs=got.logprobs if p.logprobs or p.top_logprobs else None,
        top_logprobs=got.top_logprobs if p.top_logprobs else None,
        prompt_logprobs=got.prompt_logprobs,
        matched_stop=got.matched_stop,
        error=got.error,
    )


def prompt_token_lists(prompts, input_ids, encode) -> list[list[int]]:
    """generate()'s prompts as token id lists: text prompts (one or several) encoded, or input_ids."""
    if (prompts is None) == (input_ids is None):
        raise RequestError("give exactly one of prompts or input_ids")
    if isinstance(prompts, str):
        prompts = [prompts]
    return [encode(p) for p in prompts] if prompts is not None else [list(x) for x in input_ids]


def per_prompt(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [copy.deepcopy(sp) for _ in range(n)]
    if len(sp) != n:
        raise RequestError(f"{len(sp)} sampling params for {n} prompts")
    return [copy.deepcopy(p) for p in sp]
