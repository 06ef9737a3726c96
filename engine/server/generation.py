"""The sequences of one HTTP request: submit them, merge their outputs, abort what is left.

`Sequence` is one generated choice in the serving process: a `CollectedOutput`
(engine/scheduler/output.py: token ids, log-probs and finish put back together
from the engine's deltas, as the offline Engine does) that also turns token
deltas into text deltas (incremental detokenization; text that could still turn
out to be the start of a stop string is held back, and the stop string itself is
never emitted: the engine reports the text before it). `Generation`
submits all sequences of a request (prompts x n) through the EngineClient and
yields `(index, text_delta, output)` as outputs arrive; leaving its iterator
early (client gone, error) aborts the sequences still running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from engine.grammar.spec import GrammarSpec
from engine.runtime.client import EngineClient, EngineDead, EngineUnavailable, Inbox, QueueFull
from engine.runtime.protocol import AddFailed, RequestOutput
from engine.sampling import SamplingParams
from engine.scheduler.detokenizer import text_stream
from engine.scheduler.output import CollectedOutput
from engine.server.errors import bad_request, engine_failed, server_error, unavailable


@dataclass
class Sequence(CollectedOutput):
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: object
    prompt_text: Optional[str] = None
    prompt_index: int = 0  # which prompt of the request (choices of one prompt share it)
    discard_output: bool = False  # echo-only request: the engine ran one step for prompt log-probs
    grammar: Optional[GrammarSpec] = None  # what the output must match (engine/grammar)
    text: str = ""  # text emitted so far
    rid: Optional[str] = None
    # timing (monotonic seconds) for the latency metrics
    t_submit: float = 0.0
    t_first: Optional[float] = None
    t_last: Optional[float] = None

    def __post_init__(self):
        self.detok = text_stream(self.tokenizer, self.params.skip_special_tokens)
        self.holdback = max((len(s) for s in self.params.stop), default=1) - 1
        self._pushed = 0  # output ids given to the detokenizer
        self._held = ""  # detokenized text not emitted yet

    def apply(self, out: RequestOutput) -> str:
        """Take one engine output; return the text it adds."""
        if self.discard_output:
            out = RequestOutput(out.rid, prompt_logprobs=out.prompt_logprobs,
                                prompt_top_logprobs=out.prompt_top_logprobs,
                                finish_reason=None if not out.finished else
                                "abort" if out.finish_reason == "abort" else "length")
        self.add(out)
        if not out.finished:
            self._push(len(self.output_ids))
            delta = self._held[:max(0, len(self._held) - self.holdback)]
            self._held = self._held[len(delta):]
        elif self.stop_text is not None:
            delta = self.stop_text[len(self.text):]
        else:
            self._push(len(self.visible_ids()))
            delta, self._held = self._held + self.detok.flush(), ""
        self.text += delta
        return delta

    def _push(self, upto: int) -> None:
        if upto > self._pushed:
            self._held += self.detok.push(self.output_ids[self._pushed:upto])
            self._pushed = upto


def _runs(items: list[tuple[int, object]]) -> list[tuple[int, list]]:
    """Queued (index, item) pairs grouped into runs of one sequence's consecutive outputs, in order; an output
    with prompt log-probs, and anything not an output (a failure), is a run of its own."""
    def plain(item) -> bool:
        return isinstance(item, RequestOutput) and item.prompt_logprobs is None

    runs: list[tuple[int, list]] = []
    for index, item in items:
        prev = runs[-1][1][-1] if runs and runs[-1][0] == index else None
        if plain(item) and plain(prev) and not prev.finished:
            runs[-1][1].append(item)
        else:
            runs.append((index, [item]))
    return runs


class Generation:
    def __init__(self, client: EngineClient, sequences: list[Sequence], metrics=None):
        self.client, self.sequences, self.metrics = client, sequences, metrics
        self.sink = Inbox()

    def submit(self) -> None:
        """Hand every sequence to the engine, or raise the APIError that refuses the request."""
        try:
            self.client.check_capacity(len(self.sequences))
        except QueueFull as exc:
            raise unavailable(f"the server is overloaded: {exc}; retry later") from None
        except EngineUnavailable as exc:
            raise unavailable(str(exc), retry_after=5) from None
        now = time.monotonic()
        for i, seq in enumerate(self.sequences):
            seq.t_submit = now
            seq.rid = self.client.submit(seq.prompt_ids, seq.params, self.sink, i, grammar=seq.grammar)

    async def events(self) -> AsyncIterator[tuple[int, str, RequestOutput]]:
        """(sequence index, text delta, raw output) as they arrive, until every sequence finished.

        Outputs that queued up while this request waited for the event loop (the server fell behind the
        engine's steps under load) go out as one event per run of the same sequence: one chunk carrying
        several tokens instead of several chunks written back to back, which also spares the loop the work
        of the extra chunks. An output with prompt log-probs stays an event of its own."""
        left = len(self.sequences)
        try:
            while left:
                for index, run in _runs(await self.sink.take()):
                    delta, item = "", None
                    for item in run:
                        delta += self._apply(index, item)
                    left -= bool(item.finished)
                    yield index, delta, item
        finally:
            self.abort()

    def _apply(self, index: int, item) -> str:
        """One queued item into its sequence (raising the APIError a failure is); the text it adds."""
        if isinstance(item, AddFailed):
            raise bad_request(item.message) if item.user_error else server_error(item.message)
        if isinstance(item, EngineDead):
            raise engine_failed(item.message)
        seq = self.sequences[index]
        now = time.monotonic()
        delta = seq.apply(item)
        self._observe(seq, item, now)
        if item.finish_reason == "error":  # a failed engine step: a 500, or an error event in a stream
            raise server_error(f"the request failed in the engine: {item.error}")
        return delta

    def abort(self) -> None:
        for seq in self.sequences:
            if seq.rid is not None and not seq.finished:
                self.client.abort(seq.rid)
                seq.finish_reason = "abort"
                if self.metrics is not None:
                    self.metrics.finished(seq, time.monotonic())

    def _observe(self, seq: Sequence, out: RequestOutput, now: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(seq, len(out.new_token_ids), now)
            if out.finished:
                self.metrics.finished(seq, now)
        elif out.new_token_ids:
            seq.t_first = seq.t_first or now
            seq.t_last = now

    async def collect(self) -> None:
        """Run to completion (non-streaming)."""
        async for _ in self.events():
            pass

    @property
    def usage(self) -> dict:
        prompts = {s.prompt_index: len(s.prompt_ids) for s in self.sequences}
        prompt = sum(prompts.values())
        completion = sum(len(s.output_ids) for s in self.sequences)
        cached: dict[int, int] = {}  # per prompt: the least any of its choices found in the prefix cache
        for s in self.sequences:
            cached[s.prompt_index] = min(cached.get(s.prompt_index, s.cached_tokens), s.cached_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
