"""Continuous batching with a radix prefix cache, chunked prefill and overlap scheduling.

Each `step()` launches one forward: an extend step (prefill of newly admitted
requests on top of their cached prefix, and/or the next chunk of a long prompt)
or a decode step (one token for every running request). After an extend step
the next step decodes when anything is running, so long prefills never starve
decodes.

Admission (`_build_extend`) takes waiting requests in policy order (fcfs or
lpm) while the request table, --max-running-requests, the per-step prefill
budget (--max-prefill-tokens, and --chunked-prefill-size when chunking) and KV
memory allow. A request reuses the longest cached prefix of its tokens (at most
all but its last token) and reserves slots for the rest of its prompt at once; a
prompt longer than the step budget is prefilled chunk by chunk across steps (one
such request at a time). KV memory is found by evicting unlocked radix-cache
leaves (LRU) first; when a decode step still lacks slots, the newest running
requests are retracted: their computed KV goes into the cache, their generated
tokens are kept, and they are requeued at the front, never dropped.

Overlap (default): step N launches its forward and sampling, then processes the
results of step N-1 (append tokens, stop checks, detokenisation) while the
device works; decode inputs of requests whose previous token is still on the
device are read from that step's sampled-token tensor. A request that stopped
in step N-1 may have had one more token computed in step N: it is discarded.
Requests that will certainly stop at max_new_tokens are left out of the next
launch. Before retracting, the pending results are processed first. Without
overlap every step processes its own results before returning.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from engine.errors import RequestError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner import ModelRunner
from engine.scheduler.memory import RequestMemory
from engine.scheduler.policy import POLICIES, order_waiting
from engine.scheduler.request import Request
from engine.sampling import PendingSample, sample_async


@dataclass
class Launch:
    """One launched forward whose results are not processed yet."""
    sampled: list[Request]  # rows of `sample`, in order
    sample: Optional[PendingSample]
    # (request, device log-probs of prompt tokens computed in this step, final chunk?)
    prompt_lp: list[tuple[Request, torch.Tensor, bool]] = field(default_factory=list)


@dataclass
class _Chunk:
    req: Request
    start: int
    end: int

    @property
    def final(self) -> bool:
        return self.end == len(self.req.all_ids)


class Scheduler:
    def __init__(self, runner: ModelRunner, decode_text: Callable[[list[int], bool], str], eos_ids: set[int],
                 max_prefill_tokens: Optional[int] = None, chunked_prefill_size: Optional[int] = None,
                 enable_radix_cache: Optional[bool] = None, schedule_policy: Optional[str] = None,
                 enable_overlap: Optional[bool] = None):
        args = runner.args
        pick = lambda v, name, default: v if v is not None else getattr(args, name, default)  # noqa: E731
        self.runner = runner
        self.decode_text = decode_text
        self.eos_ids = eos_ids
        self.max_prefill_tokens = pick(max_prefill_tokens, "max_prefill_tokens", 16384)
        chunk = pick(chunked_prefill_size, "chunked_prefill_size", None)
        self.chunked_prefill_size = chunk if chunk is not None and chunk > 0 else None
        if enable_radix_cache is None:
            enable_radix_cache = not getattr(args, "disable_radix_cache", False)
        self.schedule_policy = pick(schedule_policy, "schedule_policy", "fcfs")
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {self.schedule_policy!r}")
        self.overlap = enable_overlap if enable_overlap is not None else \
            not getattr(args, "disable_overlap_schedule", False)
        self.mem = RequestMemory(runner.kv_pool, runner.req_to_token, enable_radix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # requests that decode (their prompt is prefilled)
        self.prefilling: Optional[Request] = None  # a long prompt between two chunks
        self._pending: Optional[Launch] = None
        self._last_was_extend = False
        self._touched: list[Request] = []
        self._counters = {"prompt_tokens": 0, "prefix_cache_hit_tokens": 0, "retracted_requests": 0,
                          "extend_steps": 0, "decode_steps": 0}

    @property
    def cache(self):
        """The radix prefix cache (None when disabled)."""
        return self.mem.cache

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
        return bool(self.waiting or self.running or self.prefilling is not None or self._pending is not None)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = "abort"
        for req in self._active():
            if req.rid == rid and not req.finished:
                req.finish_reason = "abort"
        self._release_finished()

    def step(self) -> list[Request]:
        """Run one forward; return the requests that got a token (or finished) in the results processed now.

        With overlap those are the results of the previous step's forward.
        """
        self._touched = [r for r in self.waiting if r.finished]
        for r in self._touched:
            self.waiting.remove(r)
        launch = self._schedule_and_launch()
        if self.overlap:
            previous, self._pending = self._pending, launch
            if previous is not None:
                self._process(previous)
        elif launch is not None:
            self._process(launch)
        self._release_finished()
        touched, self._touched = self._touched, []
        return touched

    def stats(self) -> dict:
        """Prefix-cache and scheduling figures (cumulative counters since start)."""
        c = self._counters
        return {
            "prefix_cache_tokens": self.mem.cache_tokens(),
            "prefix_cache_evictable_tokens": self.cache.evictable_size() if self.cache else 0,
            "prefix_cache_evicted_tokens": self.cache.evicted_tokens if self.cache else 0,
            "prefix_cache_hit_rate": c["prefix_cache_hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "prefilling": 1 if self.prefilling is not None else 0,
            **c,
        }

    def flush(self) -> list[Request]:
        """Process the results of the step in flight (overlap), if any; return the requests touched."""
        self._touched = []
        self._sync()
        touched, self._touched = self._touched, []
        return touched

    def flush_cache(self) -> int:
        """Evict every cached prefix (only when idle); return the tokens freed, or -1 while requests run."""
        self.flush()
        if self.waiting or self.running or self.prefilling is not None:
            return -1
        return self.cache.evict_all() if self.cache is not None else 0

    # ---- scheduling ----------------------------------------------------------
    def _active(self) -> list[Request]:
        return self.running + ([self.prefilling] if self.prefilling is not None else [])

    def _decodable(self) -> list[Request]:
        """Running requests that need another token (those sure to stop at max_new_tokens are left out)."""
        limit = self.runner.max_model_len
        return [r for r in self.running if not r.finished
                and len(r.output_ids) + r.pending < r.params.max_new_tokens
                and len(r.all_ids) + r.pending < limit]

    def _schedule_and_launch(self) -> Optional[Launch]:
        decodable = self._decodable()
        if (self.prefilling is not None or self.waiting) and not (self._last_was_extend and decodable):
            chunks = self._build_extend(len(decodable))
            if chunks:
                self._last_was_extend = True
                return self._launch_extend(chunks)
        self._last_was_extend = False
        if decodable:
            reqs = self._prepare_decode()
            if reqs:
                return self._launch_decode(reqs)
        return None

    def _step_budget(self) -> int:
        if self.chunked_prefill_size is None:
            return self.max_prefill_tokens
        return min(self.max_prefill_tokens, self.chunked_prefill_size)

    def _build_extend(self, decoding: int) -> list[_Chunk]:
        """This step's prefill work: the next chunk of the prompt in progress, then new admissions."""
        budget, chunks, chunking = self._step_budget(), [], self.chunked_prefill_size is not None
        if self.prefilling is not None:
            req = self.prefilling
            end = min(len(req.all_ids), req.kv_len + budget)
            chunks.append(_Chunk(req, req.kv_len, end))
            budget -= end - req.kv_len
            if end < len(req.all_ids):
                return chunks
        order_waiting(self.waiting, self.schedule_policy, self.cache)
        slots_left = self.runner.args.max_running_requests - len(self._active())
        while self.waiting and slots_left > 0:
            if chunking and budget <= 0:
                break
            req = self.waiting[0]
            if req.finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            self.mem.match(req)
            need = len(req.all_ids) - req.prefix_len
            reserve = decoding + len(chunks) + 1  # one decode slot each for the next step
            if (not chunking and chunks and need > budget) or self.mem.headroom() - reserve < need \
                    or not self.mem.reserve(req):
                self.mem.unmatch(req)
                break
            self.waiting.popleft()
            slots_left -= 1
            self._count_admission(req)
            end = len(req.all_ids) if not chunking else min(len(req.all_ids), req.kv_len + budget)
            chunks.append(_Chunk(req, req.kv_len, end))
            budget -= end - req.kv_len
            if end < len(req.all_ids):
                break  # one chunked prompt at a time; it takes the rest of the budget
        return chunks

    def _count_admission(self, req: Request) -> None:
        if req.admitted == 0:
            req.cached_tokens = req.prefix_len
            self._counters["prompt_tokens"] += len(req.prompt_ids)
            self._counters["prefix_cache_hit_tokens"] += req.prefix_len
        req.admitted += 1
        if req.wants_prompt_logprobs:
            req.prompt_lp_partial = []

    def _prepare_decode(self) -> list[Request]:
        """The decode batch, with a KV slot available for each (evict, then retract if needed)."""
        reqs = self._decodable()
        if self.mem.make_room(len(reqs)):
            return reqs
        self._sync()  # finished requests may free memory; retraction needs processed state
        while True:
            reqs = self._decodable()
            if self.mem.make_room(len(reqs)):
                return reqs
            if len(self.running) > 1:
                self._retract(self.running.pop())
            elif self.prefilling is not None:
                self._retract(self.prefilling)
                self.prefilling = None
            else:
                for req in self.running:  # a single request that fills the whole KV pool
                    req.finish_reason = "length"
                    self._touched.append(req)
                self._release_finished()
                return []

    def _retract(self, req: Request) -> None:
        self.mem.release(req)
        req.retracted += 1
        self._counters["retracted_requests"] += 1
        self.waiting.appendleft(req)

    def _sync(self) -> None:
        if self._pending is not None:
            launch, self._pending = self._pending, None
            self._process(launch)
        self._release_finished()

    def _release_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.mem.release(req)
            self.running.remove(req)
        if self.prefilling is not None and self.prefilling.finished:
            self.mem.release(self.prefilling)
            self.prefilling = None

    # ---- forwards ----------------------------------------------------------
    def _launch_extend(self, chunks: list[_Chunk]) -> Launch:
        ids, rows, prefix_lens, extend_lens, logits_idx, start = [], [], [], [], [], 0
        for c in chunks:
            n = c.end - c.start
            ids += c.req.all_ids[c.start:c.end]
            rows.append(c.req.row)
            prefix_lens.append(c.start)
            extend_lens.append(n)
            if c.req.wants_prompt_logprobs:
                logits_idx += range(start, start + n)
            elif c.final:
                logits_idx.append(start + n - 1)
            start += n
        slots = torch.cat([c.req.slots[c.start:c.end] for c in chunks])
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, prefix_lens, extend_lens, slots, logits_idx,
                                self.runner.device)
        out = self.runner.forward(fb)
        launch, last_rows, row = Launch(sampled=[], sample=None), [], 0
        for c in chunks:
            req, n = c.req, c.end - c.start
            if req.wants_prompt_logprobs:
                targets = req.prompt_ids[c.start + 1:c.end + 1]  # the last prompt token predicts no prompt token
                logp = torch.log_softmax(out.logits[row:row + len(targets)], dim=-1)
                tgt = torch.tensor(targets, device=logp.device, dtype=torch.int64)
                launch.prompt_lp.append((req, logp.gather(1, tgt[:, None])[:, 0], c.final))
                row += n
            elif c.final:
                row += 1
            if c.final:
                last_rows.append(row - 1)
                launch.sampled.append(req)
            req.kv_len = c.end
        for c in chunks:
            if c.final:
                self.mem.cache_prefill(c.req)
                if self.prefilling is c.req:
                    self.prefilling = None
                self.running.append(c.req)
            else:
                self.prefilling = c.req
        if launch.sampled:
            launch.sample = self._sample(launch.sampled, out.logits[last_rows])
        self._counters["extend_steps"] += 1
        return launch

    def _launch_decode(self, reqs: list[Request]) -> Launch:
        slots = self.mem.append_decode_slots(reqs)
        positions = [r.kv_len - 1 for r in reqs]
        host_ids = [r.all_ids[p] if not r.pending else 0 for r, p in zip(reqs, positions)]
        fb = ForwardBatch.build(ForwardMode.DECODE, host_ids, [r.row for r in reqs], positions, [1] * len(reqs),
                                slots, list(range(len(reqs))), self.runner.device)
        if any(r.pending for r in reqs):
            fb.input_ids = self._inputs_from_pending(reqs, fb.input_ids)
        out = self.runner.forward(fb)
        self._counters["decode_steps"] += 1
        return Launch(sampled=list(reqs), sample=self._sample(reqs, out.logits))

    def _inputs_from_pending(self, reqs: list[Request], host_ids: torch.Tensor) -> torch.Tensor:
        """Decode inputs: a request's previous token is read from the device when not processed yet."""
        prev = self._pending.sample.tokens
        src = torch.tensor([r.pending_row if r.pending else -1 for r in reqs], dtype=torch.int64)
        src = src.to(prev.device)
        return torch.where(src >= 0, prev[src.clamp(min=0)], host_ids)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> PendingSample:
        res = sample_async(logits, [r.params for r in reqs], [r.generator for r in reqs]).start_copy()
        for i, req in enumerate(reqs):
            req.pending += 1
            req.pending_row = i
        return res

    # ---- results ---------------------------------------------------------------
    def _process(self, launch: Launch) -> None:
        for req, lp, final in launch.prompt_lp:
            req.prompt_lp_partial += lp.tolist()
            if final:
                req.prompt_logprobs = [None] + req.prompt_lp_partial
                req.prompt_lp_partial = []
        if launch.sample is None:
            return
        res = launch.sample.resolve()
        for req, tok, lp, top in zip(launch.sampled, res.tokens, res.logprobs, res.top):
            req.pending -= 1
            if req.finished:
                continue  # stopped (or aborted) before this token was processed: discard it
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top)
            self._check_finish(req, tok)
            self._touched.append(req)

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
