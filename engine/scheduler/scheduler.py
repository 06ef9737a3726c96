"""Continuous batching: requests join and leave the running batch at every step.

Each `step()` either prefills newly admitted requests (extend) or decodes one
token for every running request. Admission respects the request-table rows and
the KV pool; when decode runs out of KV, the newest requests are retracted (their
KV freed, their generated tokens kept) and requeued at the front, never dropped.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

from engine.errors import RequestError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner import ModelRunner
from engine.sampling import sample
from engine.scheduler.request import Request


class Scheduler:
    def __init__(self, runner: ModelRunner, decode_text: Callable[[list[int], bool], str],
                 eos_ids: set[int], max_prefill_tokens: int = 16384):
        self.runner = runner
        self.decode_text = decode_text
        self.eos_ids = eos_ids
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- public ------------------------------------------------------------
    def add(self, req: Request) -> None:
        limit = self.runner.max_model_len
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this model's context is {limit} tokens "
                               "(prompt + at least one generated token)")
        vocab = self.runner.config.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if n > self.runner.kv_pool.size:
            raise RequestError(f"the prompt has {n} tokens but the KV cache holds only {self.runner.kv_pool.size}")
        if req.params.max_new_tokens == 0:
            req.finish_reason = "length"
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = "abort"
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = "abort"
        self._release_finished()

    def step(self) -> list[Request]:
        """Run one forward; return the requests that got a token (or finished) in it."""
        done_early = [r for r in self.waiting if r.finished]
        for r in done_early:
            self.waiting.remove(r)
        batch = self._admit()
        if batch:
            self._extend(batch)
            self.running.extend(batch)
            touched = batch
        elif self.running:
            touched = list(self.running)
            self._decode()
        else:
            touched = []
        self._release_finished()
        return done_early + touched

    # ---- admission and memory ----------------------------------------------
    def _admit(self) -> list[Request]:
        pool, table = self.runner.kv_pool, self.runner.req_to_token
        batch, budget = [], self.max_prefill_tokens
        reserve = len(self.running)  # one decode slot per running request
        while self.waiting and len(self.running) + len(batch) < self.runner.args.max_running_requests:
            req = self.waiting[0]
            need = len(req.all_ids)
            if batch and need > budget:
                break
            if pool.available() - reserve < need or table.available() == 0:
                break
            self.waiting.popleft()
            req.row = table.alloc()
            req.slots = pool.alloc(need)
            table.set(req.row, 0, req.slots)
            batch.append(req)
            budget -= need
        return batch

    def _free(self, req: Request) -> None:
        if req.row is not None:
            self.runner.kv_pool.free(req.slots)
            self.runner.req_to_token.free(req.row)
        req.row, req.slots = None, torch.empty(0, dtype=torch.int64)

    def _release_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self._free(req)
            self.running.remove(req)

    def _retract_for_decode(self) -> None:
        """Requeue the newest running requests until every remaining one can get a decode slot."""
        while len(self.running) > self.runner.kv_pool.available() and len(self.running) > 1:
            req = self.running.pop()
            self._free(req)
            self.waiting.appendleft(req)
        if len(self.running) > self.runner.kv_pool.available():
            req = self.running[0]
            req.finish_reason = "length"  # a single request that fills the whole KV pool

    # ---- forwards ----------------------------------------------------------
    def _extend(self, batch: list[Request]) -> None:
        ids, rows, extend_lens, logits_idx, start = [], [], [], [], 0
        for req in batch:
            toks = req.all_ids
            ids += toks
            rows.append(req.row)
            extend_lens.append(len(toks))
            if req.params.prompt_logprobs and req.prompt_logprobs is None:
                logits_idx += list(range(start, start + len(toks)))
            else:
                logits_idx.append(start + len(toks) - 1)
            start += len(toks)
        slots = torch.cat([r.slots for r in batch])
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * len(batch), extend_lens, slots, logits_idx,
                                self.runner.device)
        out = self.runner.forward(fb)
        last_rows, row = [], 0
        for req, n in zip(batch, extend_lens):
            if req.params.prompt_logprobs and req.prompt_logprobs is None:
                logp = torch.log_softmax(out.logits[row:row + n - 1], dim=-1)
                tgt = torch.tensor(req.prompt_ids[1:n], device=logp.device)
                req.prompt_logprobs = [None] + logp.gather(1, tgt[:, None])[:, 0].tolist()
                row += n
            else:
                row += 1
            last_rows.append(row - 1)
        self._sample_and_append(batch, out.logits[last_rows])

    def _decode(self) -> None:
        self._retract_for_decode()
        reqs = [r for r in self.running if not r.finished]
        if not reqs:
            return
        slots = self.runner.kv_pool.alloc(len(reqs))
        for req, slot in zip(reqs, slots):
            self.runner.req_to_token.set(req.row, req.cached, slot[None])
            req.slots = torch.cat((req.slots, slot[None]))
        fb = ForwardBatch.build(
            ForwardMode.DECODE, [r.all_ids[-1] for r in reqs], [r.row for r in reqs],
            [r.cached - 1 for r in reqs], [1] * len(reqs), slots, list(range(len(reqs))), self.runner.device)
        out = self.runner.forward(fb)
        self._sample_and_append(reqs, out.logits)

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        res = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for req, tok, lp, top in zip(reqs, res.tokens, res.logprobs, res.top):
            if req.finished:
                continue
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top)
            self._check_finish(req, tok)

    def _check_finish(self, req: Request, tok: int) -> None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            req.finish_reason, req.matched_stop = "stop", tok
        elif tok in p.stop_token_ids:
            req.finish_reason, req.matched_stop = "stop", tok
        elif p.stop:
            text = self.decode_text(req.output_ids, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s and s in text]
            if hits:
                pos, s = min(hits)
                req.finish_reason, req.matched_stop, req.text = "stop", s, text[:pos]
                return
        if req.finish_reason is None and (
            len(req.output_ids) >= p.max_new_tokens or len(req.all_ids) >= self.runner.max_model_len
        ):
            req.finish_reason = "length"
