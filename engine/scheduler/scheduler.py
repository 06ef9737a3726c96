"""Continuous batching with a radix prefix cache, chunked prefill and overlap scheduling.

Each `step()` launches one forward: an extend step (prefill of newly admitted
requests on top of their cached prefix, and/or the next chunk of a long prompt)
or a decode step (one token for every running request). With mixed batches
(--enable-mixed-chunk; on by default) an extend step also carries one new token of
every running request (an extend of 1 token on its cached prefix; the attention
backends run such rows like decode), so streams keep advancing while long
prompts arrive; those tokens count in the step's token budget. When that cannot
be done (no budget or KV slots left for the decodes, or mixing off), after an
extend step the next step decodes when anything is running, so long prefills
never starve decodes. Steps without prefill work are plain decode steps (CUDA
graphs); extend and mixed steps replay piecewise CUDA graphs up to their largest token bucket
(engine/runner/piecewise_graph.py, the runner's choice), else run eagerly.

Admission (`_build_extend`) takes waiting requests in policy order (fcfs or
lpm) while the request table, --max-running-requests, the per-step prefill
budget (--max-prefill-tokens, and --chunked-prefill-size when chunking; while
requests decode, the cap of prefill_budget.py that keeps a stream's inter-token gap
within --itl-target-ms, by default 3x the recent decode step) and KV memory allow. In a burst
of arrivals (more waiting requests could start now than are decoding: at start, after a wave
of finishes) the cap gives way: pure prefill steps at the full budget run back to back, the
decodes waiting, so a running stream waits once for the burst instead of once per capped
step, and the burst's requests start together (`_burst`; --no-prefill-burst keeps the cap). A request reuses the
longest cached prefix of its tokens (at most all but its last token) and
reserves slots for the rest of its prompt at once; a prompt longer than the
step budget is prefilled chunk by chunk across steps (one such request at a
time). KV memory must also cover a reservation for the tokens
the admitted requests will still generate (admission.py), so what is admitted
can keep decoding. KV memory is found by evicting unlocked radix-cache leaves
(LRU) first; when a decode step still lacks slots, the newest requests are
retracted (a chunked prefill in progress first, then the newest running ones):
their computed KV goes into the cache, their generated tokens are kept, and they
are requeued at the front, never dropped; readmitted, they prefill prompt plus
output (mostly a cache hit) and go on where they stopped.

Failures: if a step raises (an out-of-memory error, a kernel error, anything),
the requests of that step's batch finish with reason "error" and the message,
their KV is freed without being cached (it may be half written), and the
scheduler goes on with the others; a request whose output processing raises
fails alone (processor.py). The decodes of a failed mixed step are not failed:
they give back the slot of the token they did not get and run alone in the
next step (the prefill is the likely cause; if they fail alone, they fail).
After MAX_CONSECUTIVE_FAILED_STEPS failed steps in a row the error is raised:
the device is presumably unusable, and the engine process ends (the server then
reports it down) rather than fail every request.

Overlap (default): step N launches its forward and sampling, then processes the
results of step N-1 (append tokens, stop checks, detokenisation) while the
device works; decode inputs of requests whose previous token is still on the
device are read from that step's sampled-token tensor. A request that stopped
in step N-1 may have had one more token computed in step N: it is discarded.
Requests that will certainly stop at max_new_tokens are left out of the next
launch. Before retracting, the pending results are processed first. Without
overlap every step processes its own results before returning.

Results: the scheduler only decides what runs and launches it. Resolved samples
and prompt log-probs go to the `OutputProcessor` (processor.py), which updates
the requests (tokens, stops, finish) and gathers the per-request deltas that
`take_outputs()` hands to the caller (the server's engine loop or the offline
Engine). Finishes decided here (abort, KV pool too small, max_new_tokens 0, a
failed step) go through it too, so every finish produces its delta. Prompts are
checked by `prompt_check.check_prompt`, the same check the server runs.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.args import SchedulerArgs
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.grammar.matcher import GrammarMasks
from engine.grammar.pending import PendingGrammars
from engine.memory.request_memory import RequestMemory
from engine.runner.model_runner import ModelRunner
from engine.sampling import PendingSample, sample_async
from engine.scheduler.admission import Reservation
from engine.scheduler.history import sampling_history, tokens_in_flight
from engine.scheduler.output import RequestOutput
from engine.scheduler.policy import POLICIES, order_waiting
from engine.scheduler.prefill_budget import PrefillBudget
from engine.scheduler.processor import OutputProcessor
from engine.scheduler.prompt_check import PromptLimits, check_prompt
from engine.scheduler.request import Request
from engine.scheduler.step_times import StepTimes

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 8
BURST_MAX_STEPS = 32  # prefill steps in a row while requests wait to decode (`_burst`): 262k tokens at 8192 a step
SLOW_DECODE_S, SLOW_DECODE_FACTOR = 0.1, 4.0  # a decode step over both is logged (a stall every stream sees)


@dataclass
class HostWork:
    """One step's host work besides its forward: releasing what the step before finished, processing results."""
    seconds: float = 0.0
    released: int = 0


@dataclass
class Launch:
    """One launched forward whose results are not processed yet."""
    sampled: list[Request]  # rows of `sample`, in order
    sample: Optional[PendingSample]
    # (request, device log-probs of prompt tokens computed in this step, final chunk?)
    prompt_lp: list[tuple[Request, torch.Tensor, bool]] = field(default_factory=list)
    kind: str = "decode"  # step_times.KINDS
    launched: float = 0.0  # time.perf_counter() when scheduling it began
    tokens: int = 0  # every token of this step (extend steps: prompt tokens and mixed decode rows)
    done: Optional[torch.cuda.Event] = None  # CUDA: recorded after a step that samples nothing


@dataclass
class _Chunk:
    req: Request
    start: int
    end: int

    @property
    def final(self) -> bool:
        return self.end == len(self.req.token_ids)


class Scheduler:
    def __init__(self, runner: ModelRunner, outputs: OutputProcessor, args: SchedulerArgs, radix_cache: bool = True,
                 attention_groups: int = 1):
        """Scheduling flags come from `args`; `radix_cache` shares cached prompt prefixes between requests;
        `attention_groups`: the DP attention groups that share the prefill step budget (EngineArgs')."""
        self.runner = runner
        self.outputs = outputs
        self.limits = PromptLimits(runner.max_model_len, runner.config.vocab_size, runner.kv_pool.size)
        self.max_running = runner.max_running_requests  # the request table is sized by the runner
        self.step_budget = args.step_budget(attention_groups)  # most tokens one prefill step computes
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size = chunk if chunk is not None and chunk > 0 else None
        self.schedule_policy = args.schedule_policy
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {self.schedule_policy!r}")
        self.overlap = not args.disable_overlap_schedule
        self.mixed = args.enable_mixed_chunk
        self.prefill_burst = args.prefill_burst
        self.mem = RequestMemory(runner.kv_pool, runner.req_to_token, radix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # requests that decode (their prompt is prefilled)
        self.prefilling: Optional[Request] = None  # a long prompt between two chunks
        self._pending: Optional[Launch] = None
        self._last_was_extend = False
        self._burst_steps = 0  # steps of the burst going on (the decodes' stall, in steps; 0: none)
        self._burst_rest = 0  # steps before another burst may start, after one cut at BURST_MAX_STEPS
        self.reservation = Reservation(runner.max_model_len)
        self._launching: list[Request] = []  # the batch of the forward being launched (failed if it raises)
        self._riding: list[Request] = []  # the decodes of the mixed batch being launched (retried if it raises)
        self._mix_after_failure = True  # False for one step after a mixed step failed: decodes go alone
        self._failed_in_a_row = 0
        self.spec = None  # speculative decoding (engine/speculative/decoder.py), attached by Engine
        self.grammar_masks: Optional[GrammarMasks] = None  # grammar-constrained requests' masks, attached by Engine
        self.compiling = PendingGrammars()  # requests whose grammar compiles, not queued until it is ready
        self._counters = {"prompt_tokens": 0, "prefix_cache_hit_tokens": 0, "retracted_requests": 0,
                          "extend_steps": 0, "decode_steps": 0, "mixed_steps": 0, "failed_steps": 0,
                          "failed_requests": 0}
        self.step_times = StepTimes()
        self.prefill_budget = PrefillBudget(args.itl_target_ms, args.min_prefill_tokens)
        self._last_done = 0.0  # time.perf_counter() when the last step's results came in
        self._host = HostWork()  # the last step's processing of results and releases (for the slow-step log)

    @property
    def cache(self):
        """The radix prefix cache (None when disabled)."""
        return self.mem.cache

    # ---- public ------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request (a bad prompt raises PromptError; max_new_tokens 0 finishes at once)."""
        check_prompt(req.prompt_ids, self.limits)
        if req.params.max_new_tokens == 0:
            self.outputs.finish(req, "length")
            return
        if req.grammar is not None and not req.grammar.ready:
            self.compiling.add(req)
            return
        if req.grammar is not None:
            req.grammar.start()
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Anything to step, finished requests not released yet included (the next step releases them)."""
        return self._busy() or bool(self.compiling)

    def _busy(self) -> bool:
        """Requests queued or running, or a step in flight (requests whose grammar compiles aside)."""
        return bool(self.waiting or self.running or self.prefilling is not None or self._pending is not None)

    def _queue_compiled(self) -> None:
        """Queue the requests whose grammar finished compiling; fail those whose compile failed. With nothing
        else to run, wait a moment for a compile first (rather than spin)."""
        if not self._busy():
            self.compiling.wait()
        for req, error in self.compiling.ready():
            if error is None:
                self.waiting.append(req)
            else:
                self.outputs.finish(req, "error", error=error)

    def abort(self, rid: str) -> None:
        self._abort(lambda req: req.rid == rid)

    def abort_all(self) -> None:
        self._abort(lambda req: True)

    def _abort(self, which) -> None:
        for req in self.compiling.remove(which):
            self.outputs.finish(req, "abort")
        for req in [r for r in self.waiting if which(r)]:
            self.waiting.remove(req)
            self.outputs.finish(req, "abort")
        for req in self._active():
            if which(req) and not req.finished:
                self.outputs.finish(req, "abort")
        self._release_finished()

    def step(self) -> None:
        """Run one forward and process the results due now (with overlap: those of the previous forward).

        A forward (or its sampling, or the reading of its results) that raises fails the requests of
        its batch, not the scheduler; see the module docstring. The requests the step before finished are
        released here, first: their last outputs went out between the two steps, before that bookkeeping
        (the radix-cache insert of a wave of equal requests ending together took 16-30 ms for 256)."""
        release = self.release_finished()
        if self.compiling:
            self._queue_compiled()
        t0 = time.perf_counter()
        try:
            launch = self._schedule_and_launch()
            if launch is not None:
                launch.launched = t0
        except Exception as exc:  # noqa: BLE001 - the batch fails, the engine goes on
            self._unride()
            self._fail(self._launching, exc)
            launch = None
        self._launching, self._riding = [], []
        t1 = time.perf_counter()
        if self.overlap:
            previous, self._pending = self._pending, launch
            if previous is not None:
                self._process(previous)
        elif launch is not None:
            self._process(launch)
        self._host = HostWork(release.seconds + time.perf_counter() - t1, release.released)

    def take_outputs(self) -> list[RequestOutput]:
        """Per-request deltas since the last call (new tokens, prompt log-probs, finishes)."""
        return self.outputs.take()

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
            "step_seconds": self.step_times.as_dict(),
            **(self.spec.stats.as_dict() if self.spec is not None else {}),
        }

    def flush(self) -> None:
        """Process the results of the step in flight (overlap), if any."""
        self._sync()

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
        limit = self.limits.max_model_len
        out = []
        for r in self.running:  # per step over the batch: attributes only, no property calls
            n = len(r.token_ids) + r.pending
            if r.finish_reason is None and n - r.prompt_len < r.params.max_new_tokens and n < limit:
                out.append(r)
        return out

    def _schedule_and_launch(self) -> Optional[Launch]:
        self._launching = []
        self._burst_rest = max(0, self._burst_rest - 1)
        decodable = self._decodable()
        if self.prefilling is not None or self.waiting:
            burst = self._burst(decodable)
            mixed = not burst and self._can_mix(decodable)
            if burst or mixed or not (self._last_was_extend and decodable):
                riding = len(decodable) if mixed else 0
                budget = self.step_budget - riding
                if self.chunked_prefill_size is not None and not burst:  # a cap on prompt tokens while streams wait
                    budget = self._fill_bucket(self.prefill_budget.tokens(budget, len(decodable), mixed), riding)
                chunks = self._build_extend(len(decodable), budget)
                if chunks:
                    self._last_was_extend = True
                    return self._launch_extend(chunks, decodable if mixed else [])
        self._last_was_extend, self._burst_steps = False, 0  # a burst ends with the first step not one of it
        if decodable:
            if self.spec is not None:
                # a speculative step replaces the decode step; not while a grammar constrains a request
                if self.spec.speculates(len(decodable)) and not any(r.grammar is not None for r in decodable):
                    return self._launch_spec()
                decodable = self._spec_catch_up(decodable)
            reqs = self._prepare_decode(decodable)
            if reqs:
                return self._launch_decode(reqs)
        return None

    def _burst(self, decodable: list[Request]) -> bool:
        """Whether this step belongs to a burst (only with the prefill cap on and --prefill-burst): one starts
        when more waiting requests could start now than are decoding, and goes on while any could, so every
        request of the burst starts (a stream admitted early waits once, for all of it), for at most
        BURST_MAX_STEPS steps; one cut there is followed by as many steps without a burst. Counted over the head
        of the queue against the free request slots and the KV room left after what runs reserves (whole
        prompts, no cache hit assumed). Reads scheduler state only: TP ranks that mirror one scheduler agree."""
        n = len(decodable)
        if not (self.prefill_burst and n and self.chunked_prefill_size is not None and self.prefill_budget.enabled):
            self._burst_steps = 0
            return False
        if self._burst_steps >= BURST_MAX_STEPS:  # the decodes waited long enough: as many steps for them now
            self._burst_steps, self._burst_rest = 0, BURST_MAX_STEPS
        if self._burst_rest:
            return False
        need = 1 if self._burst_steps else n + 1
        self._burst_steps = self._burst_steps + 1 if self._startable(need, n) >= need else 0
        return self._burst_steps > 0

    def _startable(self, most: int, decoding: int) -> int:
        """How many requests (at most `most`) could start now: the prompt in progress, then the head of the
        queue while request slots and KV room (after the reservation of what runs) last."""
        active = self._active()
        count = int(self.prefilling is not None)
        slots = self.max_running - len(active)
        room = self.mem.headroom() - self.reservation.total(active) - decoding
        for req in itertools.islice(self.waiting, max(0, min(most - count, slots))):
            room -= len(req.token_ids) + self.reservation.future(req)
            if room < 0:
                break
            count += 1
        return count

    def _can_mix(self, decodable: list[Request]) -> bool:
        """Whether this extend step can carry the decodes: mixing is on, prefill budget is left after one
        token per decode, and a KV slot is free for each (evicting from the cache; never retracting).
        Not with speculative decoding (its steps keep draft state that a plain decode would not advance),
        nor in the step after a failed mixed step (the decodes then run alone)."""
        ok, self._mix_after_failure = self._mix_after_failure, True
        return bool(ok and self.mixed and self.spec is None and decodable and self.step_budget > len(decodable)
                    and self.mem.make_room(len(decodable)))

    def _fill_bucket(self, budget: int, riding: int) -> int:
        """The prompt-token budget lowered so that a full step (with `riding` decode rows) fills a piecewise-graph
        token bucket exactly instead of padding up to the next one (no change without buckets, past the largest
        one, or when the decodes alone fill the largest bucket under the budget)."""
        buckets = self.runner.extend_buckets
        if not buckets or budget + riding > buckets[-1]:
            return budget  # past the largest bucket the step runs eagerly, at any size
        i = bisect.bisect_right(buckets, budget + riding) - 1
        return buckets[i] - riding if i >= 0 and buckets[i] > riding else budget

    def _build_extend(self, decoding: int, budget: int) -> list[_Chunk]:
        """This step's prefill work within `budget` tokens: the next chunk of the prompt in progress, then new
        admissions. `decoding` running requests need a KV slot each (this step when mixed, else the next)."""
        chunks, chunking = [], self.chunked_prefill_size is not None
        if self.prefilling is not None:
            req = self.prefilling
            end = min(len(req.token_ids), req.kv_len + budget)
            chunks.append(_Chunk(req, req.kv_len, end))
            budget -= end - req.kv_len
            if end < len(req.token_ids):
                return chunks
        order_waiting(self.waiting, self.schedule_policy, self.cache)
        active = self._active()
        slots_left = self.max_running - len(active)
        future: Optional[int] = None  # the reservation of everything admitted (O(running): made when needed)
        while self.waiting and slots_left > 0:
            if chunking and budget <= 0:
                break
            req = self.waiting[0]
            self.mem.match(req)
            need = len(req.token_ids) - req.prefix_len
            # Room for req's tokens, one decode slot each for the next step and the expected future tokens
            # of everything admitted; a request admitted alone needs only its own tokens (it always makes
            # progress).
            alone, mine = not (active or chunks), 0
            fits = (chunking or not chunks or need <= budget) and \
                self.mem.headroom() - (0 if alone else decoding + len(chunks) + 1) >= need
            if fits and not alone:
                if future is None:
                    future = self.reservation.total(active + [c.req for c in chunks if c.req is not self.prefilling])
                mine = self.reservation.future(req)
                fits = self.mem.headroom() - (future + mine) >= need
            if not fits or not self.mem.reserve(req):
                self.mem.unmatch(req)
                break
            if future is not None:
                future += mine
            self.waiting.popleft()
            slots_left -= 1
            self._count_admission(req)
            total = len(req.token_ids)
            end = total if not chunking else min(total, req.kv_len + budget)
            chunks.append(_Chunk(req, req.kv_len, end))
            budget -= end - req.kv_len
            if end < total:
                break  # one chunked prompt at a time; it takes the rest of the budget
        return chunks

    def _count_admission(self, req: Request) -> None:
        if req.admitted == 0:
            req.cached_tokens = req.prefix_len
            self._counters["prompt_tokens"] += req.prompt_len
            self._counters["prefix_cache_hit_tokens"] += req.prefix_len
        req.admitted += 1
        if req.wants_prompt_logprobs:
            req.prompt_lp_partial = []

    def _prepare_decode(self, reqs: list[Request], per_req: int = 1) -> list[Request]:
        """The decode batch (`reqs`: the decodable requests), with a KV slot available for each: evict from
        the cache, then retract the newest requests (a chunked prefill in progress first) if needed."""
        if self.mem.make_room(len(reqs) * per_req):
            return reqs
        self._sync()  # finished requests may free memory; retraction needs processed state
        retracted = False
        while True:
            reqs = self._decodable()
            if self.mem.make_room(len(reqs) * per_req):
                break
            if self.prefilling is not None:  # the newest admission; it holds slots for its whole prompt
                victim, self.prefilling = self.prefilling, None
            elif len(self.running) > 1:
                victim = self.running.pop()
            else:
                for req in self.running:  # a single request that fills the whole KV pool
                    self.outputs.finish(req, "length")
                self._release_finished()
                reqs = []
                break
            self._retract(victim)
            retracted = True
        if retracted:
            self.reservation.retracted()
        return reqs

    def _retract(self, req: Request) -> None:
        """Free req's KV (its computed part goes into the cache) and requeue it at the front; readmitted,
        it prefills its prompt and output so far (recompute) and goes on."""
        self.mem.release(req)
        req.retracted += 1
        self._counters["retracted_requests"] += 1
        self.waiting.appendleft(req)

    def _sync(self) -> None:
        if self._pending is not None:
            launch, self._pending = self._pending, None
            self._process(launch)
        self._release_finished()

    def release_finished(self) -> HostWork:
        """Release the finished requests now (each step starts with this); what it took and how many."""
        t, before = time.perf_counter(), len(self.running)
        self._release_finished()
        return HostWork(time.perf_counter() - t, before - len(self.running))

    def _release_finished(self) -> None:
        if any(r.finish_reason is not None for r in self.running):  # every step: an attribute, not a property
            done = [r for r in self.running if r.finished]
            self.running = [r for r in self.running if not r.finished]
            for req in done:
                self._release(req)
        if self.prefilling is not None and self.prefilling.finished:
            self._release(self.prefilling)
            self.prefilling = None

    def _release(self, req: Request) -> None:
        """Free a finished request's KV; what a failed request computed is not cached (maybe half written)."""
        self.mem.release(req, keep=req.finish_reason != "error")

    # ---- failures ----------------------------------------------------------------
    def _unride(self) -> None:
        """A mixed step raised before sampling: the prefill is the likely cause (a long prompt's memory), so
        its decodes give back the KV slot they got (their tokens are not computed) and decode again next
        step on their own; should that fail too, they fail then."""
        if self._riding:
            self.mem.drop_decode_slots(self._riding)
            self._riding = []
            self._mix_after_failure = False
    def _fail(self, batch: list[Request], exc: BaseException) -> None:
        """A step of `batch` raised: those requests finish with reason "error"; the rest go on."""
        self._counters["failed_steps"] += 1
        self._failed_in_a_row += 1
        message = f"{type(exc).__name__}: {exc}".strip()
        log.error("a step of %d request(s) failed: %s", len(batch), message, exc_info=exc)
        listed = {id(r) for r in self.running} | {id(self.prefilling)} | {id(r) for r in self.waiting}
        for req in {id(r): r for r in batch}.values():
            if not req.finished:
                self._counters["failed_requests"] += 1
                self.outputs.finish(req, "error", error=message)
            if id(req) not in listed:  # admitted in the failed step, in no list yet: release it here
                self._release(req)
        self._release_finished()
        if self._failed_in_a_row >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_in_a_row} steps in a row failed; the last: {message}") from exc

    # ---- forwards ----------------------------------------------------------
    def _launch_extend(self, chunks: list[_Chunk], decodes: list[Request]) -> Launch:
        """Prefill chunks and, in a mixed batch, one new token for each of `decodes` (placed after the chunks;
        each is an extend of 1 token on its cached KV). Chunks sample on their prompt's last token only."""
        if decodes and not self.mem.make_room(len(decodes)):
            decodes = []  # admission kept room for them; should the cache not yield it, they decode next step
        self._launching = [c.req for c in chunks]
        ids, rows, prefix_lens, extend_lens, logits_idx, start = [], [], [], [], [], 0
        for c in chunks:
            n = c.end - c.start
            ids += c.req.token_ids[c.start:c.end]
            rows.append(c.req.row)
            prefix_lens.append(c.start)
            extend_lens.append(n)
            if c.req.wants_prompt_logprobs:
                logits_idx += range(start, start + n)
            elif c.final:
                logits_idx.append(start + n - 1)
            start += n
        slots = [c.req.slots[c.start:c.end] for c in chunks]
        if decodes:
            slots.append(self.mem.append_decode_slots(decodes))
            self._riding = decodes
            for r in decodes:
                p = r.kv_len - 1  # the new token's position (append_decode_slots advanced kv_len)
                ids.append(r.token_ids[p] if not r.pending else 0)
                rows.append(r.row)
                prefix_lens.append(p)
                extend_lens.append(1)
            logits_idx += range(start, start + len(decodes))
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, prefix_lens, extend_lens, torch.cat(slots),
                                logits_idx, self.runner.device)
        if any(r.pending for r in decodes):
            fb.input_ids = torch.cat((fb.input_ids[:start], self._inputs_from_pending(decodes, fb.input_ids[start:])))
        out = self.runner.forward(fb)
        if self.spec is not None:
            self.spec.after_extend(chunks, out)
        launch, last_rows, row = Launch(sampled=[], sample=None, kind="mixed" if decodes else "extend"), [], 0
        launch.tokens = sum(c.end - c.start for c in chunks) + len(decodes)
        for c in chunks:
            req, n = c.req, c.end - c.start
            if req.wants_prompt_logprobs:
                # the last prompt token predicts no prompt token
                targets = req.token_ids[c.start + 1:min(c.end + 1, req.prompt_len)]
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
        if decodes:
            last_rows += range(row, row + len(decodes))
            launch.sampled += decodes
            self._counters["mixed_steps"] += 1
            self.reservation.decode_step()
        if launch.sampled:
            logits = out.logits if len(last_rows) == out.logits.shape[0] else out.logits[last_rows]
            launch.sample = self._sample(launch.sampled, logits)
        elif self.runner.device.type == "cuda":  # nothing to resolve: an event tells when it is done
            launch.done = torch.cuda.Event()
            launch.done.record()
        self._counters["extend_steps"] += 1
        return launch

    def _launch_decode(self, reqs: list[Request]) -> Launch:
        self._launching = reqs
        slots = self.mem.append_decode_slots(reqs)
        positions = [r.kv_len - 1 for r in reqs]
        host_ids = [r.token_ids[p] if not r.pending else 0 for r, p in zip(reqs, positions)]
        fb = ForwardBatch.build(ForwardMode.DECODE, host_ids, [r.row for r in reqs], positions, [1] * len(reqs),
                                slots, list(range(len(reqs))), self.runner.device)
        if any(r.pending for r in reqs):
            fb.input_ids = self._inputs_from_pending(reqs, fb.input_ids)
        out = self.runner.forward(fb)
        if self.spec is not None:  # speculation off for this batch size: the draft layer's KV waits
            self.spec.after_plain_decode(reqs, out.hidden)
        self._counters["decode_steps"] += 1
        self.reservation.decode_step()
        return Launch(sampled=list(reqs), sample=self._sample(reqs, out.logits))

    def _launch_spec(self) -> None:
        """The decode step with speculative decoding: the spec decoder drafts, verifies, accepts and emits
        synchronously (its steps read the tree on the host), so the step in flight is processed first and
        nothing is left pending. Each request needs KV for its whole tree (`slots_per_req`)."""
        self._sync()
        reqs = self._decodable()
        if reqs:
            reqs = self._prepare_decode(reqs, self.spec.slots_per_req)
        if not reqs:
            return None
        self._launching = reqs
        t0 = time.perf_counter()
        self.spec.step(reqs, self.outputs, self.mem)
        self._step_done(Launch(sampled=[], sample=None, kind="spec", launched=t0))
        self._counters["decode_steps"] += 1
        self.reservation.decode_step()
        self._failed_in_a_row = 0
        return None

    def _spec_catch_up(self, decodable: list[Request]) -> list[Request]:
        """Before a plain decode step with speculation on: when a request has run enough plain steps
        (`SpecDecoder.catch_up_due`), write the draft KV of every decodable request's pending positions in
        forwards of at most a prefill step's tokens (the step in flight is processed first: those positions'
        next tokens must be known). Returns the decodable requests after that."""
        if not self.spec.catch_up_due(decodable):
            return decodable
        self._sync()
        decodable = self._decodable()
        self.spec.catch_up(decodable, self.step_budget)
        return decodable

    def _inputs_from_pending(self, reqs: list[Request], host_ids: torch.Tensor) -> torch.Tensor:
        """Decode inputs: a request's previous token is read from the device when not processed yet."""
        return tokens_in_flight(reqs, self._pending.sample.tokens, host_ids)

    def _step_done(self, launch: Launch) -> None:
        """A step's results are in: its time from the later of its launch and the previous step's end."""
        now = time.perf_counter()
        seconds = now - max(launch.launched, self._last_done)
        usual = self.prefill_budget.decode_s
        if launch.kind == "decode" and usual and seconds > max(SLOW_DECODE_S, SLOW_DECODE_FACTOR * usual):
            log.warning("a decode step of %d requests took %.0f ms (recent decode steps %.1f ms); the host's "
                        "processing of the step before took %.0f ms and released %d finished requests",
                        len(launch.sampled), 1e3 * seconds, 1e3 * usual, 1e3 * self._host.seconds,
                        self._host.released)
        self.step_times.record(launch.kind, seconds)
        self.prefill_budget.observe(launch.kind, launch.tokens, seconds)
        self._last_done = now

    def _constrain(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Mask the logits of grammar-constrained requests (in place, on the device) before sampling. Their
        previous token must be in their matcher first: with overlap, the step in flight is processed here
        (its forward and this step's are already queued, so the device keeps working meanwhile)."""
        if self._pending is not None and any(r.grammar is not None and r.pending for r in reqs):
            launch, self._pending = self._pending, None
            self._process(launch)
        self.grammar_masks.apply(logits, [r.grammar for r in reqs])

    def _advance_grammars(self, live: list[tuple[Request, int]]) -> None:
        """Feed each appended token to its request's matcher; a completed grammar ends the request ("stop"),
        a token the grammar refuses (not expected: the mask forbids it) fails it."""
        for req, tok in live:
            if not req.grammar.accept(tok):
                if not req.finished:
                    self.outputs.finish(req, "error", error=f"token {tok} does not match the request's grammar")
            elif req.grammar.terminated and not req.finished:
                self.outputs.finish(req, "stop", tok)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> PendingSample:
        if any(r.grammar is not None for r in reqs):
            self._constrain(reqs, logits)
        pending = self._pending.sample if self._pending is not None else None
        previous = pending.tokens if pending is not None else None
        history = sampling_history(reqs, self.outputs.eos_ids, previous, logits.device)
        res = sample_async(logits, [r.params for r in reqs], [r.generator for r in reqs], history)
        self.runner.share_sampled(res.tokens)  # TP: every rank continues with rank 0's tokens
        res.start_copy()
        for i, req in enumerate(reqs):
            req.pending += 1
            req.pending_row = i
        return res

    # ---- results ---------------------------------------------------------------
    def _process(self, launch: Launch) -> None:
        """Hand a step's results to the output processor (a step whose results cannot be read fails)."""
        for req in launch.sampled:
            req.pending -= 1
        try:
            for req, lp, final in launch.prompt_lp:
                self.outputs.prompt_logprobs(req, lp, final)
            if launch.sample is None:
                if launch.done is not None:
                    launch.done.synchronize()
                self._step_done(launch)
                return
            res = launch.sample.resolve()
        except Exception as exc:  # noqa: BLE001 - e.g. a device error that surfaces at the copy
            self._fail(launch.sampled + [req for req, _, _ in launch.prompt_lp], exc)
            return
        self._step_done(launch)
        self._failed_in_a_row = 0
        live = [(r, t) for r, t in zip(launch.sampled, res.tokens) if r.grammar is not None and r.finish_reason is None]
        self.outputs.process(launch.sampled, res)
        if live:
            self._advance_grammars(live)
