"""OutputProcessor: the one place where a step's resolved samples become request state and output deltas.

The scheduler decides what runs and launches forwards; when a step's samples are
resolved it hands them here. Updating state: append the token to the request;
finish on EOS (unless ignore_eos), a stop token id, a stop string (matched
incrementally, stops.py; none of these before min_tokens output tokens),
max_new_tokens or the context length; mark the prompt
log-probs done after a prompt's last chunk; record the finishes the scheduler
decides (abort, KV pool too small, max_new_tokens 0, a failed step: reason
"error" with its message). A request whose update raises (a tokenizer error in
the stop-string check, say) finishes with "error" alone. That transition depends on
the sampled tokens and the request's parameters only (no clock, no randomness),
so identical copies of the scheduler fed the same tokens (tensor-parallel ranks)
end in identical states.

Producing deltas is separate: only a processor with `emit` on (the rank that
answers) gathers, per request, what it gained (`RequestOutput`: new tokens and
log-probs, prompt log-probs once, the finish) until `take()` hands them over.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from engine.scheduler.output import RequestOutput
from engine.scheduler.stops import StopStrings

if TYPE_CHECKING:
    from engine.sampling import SampleResult
    from engine.scheduler.request import Request

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int, emit: bool = True):
        self.tokenizer = tokenizer  # for stop strings; None: no text, stop strings never match
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.emit = emit
        self._deltas: dict[str, RequestOutput] = {}

    # ---- state ---------------------------------------------------------------------
    def process(self, reqs: list["Request"], result: "SampleResult") -> None:
        """One sampled token per request of a step (tokens of requests already finished are discarded)."""
        for req, tok, lp, top in zip(reqs, result.tokens, result.logprobs, result.top):
            if req.finish_reason is None:  # not stopped or aborted before this token was processed
                try:
                    self._append(req, tok, lp, top)
                except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("processing a token of request %s failed", req.rid)
                    self.finish(req, "error", error=f"{type(exc).__name__}: {exc}")

    def prompt_logprobs(self, req: "Request", values, final: bool) -> None:
        """Log-probs of one prefill chunk's prompt tokens (a tensor); after the last chunk they are done."""
        if req.finished:
            return
        if self.emit:
            req.prompt_lp_partial += values.tolist()
        if final:
            req.prompt_lp_done = True
            if self.emit:
                self._delta(req).prompt_logprobs = [None] + req.prompt_lp_partial  # the first token has none
            req.prompt_lp_partial = []

    def finish(self, req: "Request", reason: str, matched: object = None, stop_text: Optional[str] = None,
               error: Optional[str] = None) -> None:
        """End req (`error`: the message, with reason "error")."""
        req.finish_reason, req.matched_stop, req.stop_matcher = reason, matched, None
        if self.emit:
            d = self._delta(req)
            d.finish_reason, d.matched_stop, d.stop_text, d.error = reason, matched, stop_text, error

    def _append(self, req: "Request", tok: int, lp: float, top: list) -> None:
        """Append one token and check whether it ends req (the per-token hot path: O(1), no rebuilds)."""
        ids = req.token_ids
        ids.append(tok)
        if self.emit:
            d = self._deltas.get(req.rid) or self._delta(req)
            d.new_token_ids.append(tok)
            if d.new_logprobs is not None:
                d.new_logprobs.append(lp)
                if d.new_top_logprobs is not None:
                    d.new_top_logprobs.append(top)
        p = req.params
        early = len(ids) - req.prompt_len < p.min_tokens  # no stop of any kind before min_tokens
        if not early and ((tok in self.eos_ids and not p.ignore_eos) or (p.stop_token_ids and tok in p.stop_token_ids)):
            self.finish(req, "stop", tok)
            return
        hit = self._stop_string(req, tok, not early) if p.stop else None
        if hit is not None:
            self.finish(req, "stop", *hit)
        elif len(ids) - req.prompt_len >= p.max_new_tokens or len(ids) >= self.max_model_len:
            self.finish(req, "length")

    def _stop_string(self, req: "Request", tok: int, match: bool) -> Optional[tuple[str, str]]:
        matcher = req.stop_matcher
        if matcher is None:
            if not any(req.params.stop):
                return None
            matcher = req.stop_matcher = StopStrings(req.params.stop, self.tokenizer, req.params.skip_special_tokens)
        return matcher.push(tok, match)

    # ---- deltas ---------------------------------------------------------------------
    def _delta(self, req: "Request") -> RequestOutput:
        d = self._deltas.get(req.rid)
        if d is None:
            p = req.params
            d = self._deltas[req.rid] = RequestOutput(req.rid, cached_tokens=req.cached_tokens)
            if p.logprobs or p.top_logprobs:
                d.new_logprobs = []
            if p.top_logprobs:
                d.new_top_logprobs = []
        return d

    def take(self) -> list[RequestOutput]:
        """The deltas gathered since the last call, one per request that moved (none unless emit is on)."""
        out, self._deltas = list(self._deltas.values()), {}
        return out
