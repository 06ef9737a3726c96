"""The engine process: owns the Engine (scheduler + model) and runs the forward loop.

It is started by the serving process (multiprocessing, spawn) with two pipes. The
loop drains incoming messages (add / abort / shutdown), runs `scheduler.step()`
while there is work, and after each step sends every request's new tokens,
log-probs and finish state back, with the scheduler's load and KV statistics.
When idle it blocks on the inbox; when the serving process goes away (pipe EOF)
it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

from engine.args import EngineArgs
from engine.errors import DsctlError
from engine.server.protocol import (AbortRequest, AddFailed, AddRequest, EngineFailed, EngineInfo, EngineStats,
                                    RequestOutput, Shutdown, StepOutputs)

log = logging.getLogger("dsctl.engine")


@dataclass
class _Tracked:
    req: object  # engine.scheduler.request.Request
    sent: int = 0  # output tokens already sent
    prompt_sent: bool = False


def scheduler_stats(scheduler, runner) -> EngineStats:
    """Load, memory and prefix-cache figures."""
    pool, extra = runner.kv_pool, scheduler.stats()
    return EngineStats(running=len(scheduler.running) + extra["prefilling"],  # + a chunked prefill in progress
                       waiting=len(scheduler.waiting), kv_total_tokens=int(pool.size),
                       kv_free_tokens=int(pool.available()), prefix_cache_tokens=extra["prefix_cache_tokens"],
                       prefix_cache_hit_rate=extra["prefix_cache_hit_rate"])


class EngineLoop:
    """Message handling and output diffing around one Engine."""

    def __init__(self, engine, outbox: Connection):
        self.engine = engine
        self.outbox = outbox
        self.active: dict[str, _Tracked] = {}

    def handle(self, msg) -> bool:
        """Apply one message; False when the loop should stop."""
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            tracked = self.active.get(msg.rid)
            if tracked is not None:
                self.engine.scheduler.abort(tracked.req.rid)
        elif isinstance(msg, Shutdown):
            for tracked in self.active.values():
                self.engine.scheduler.abort(tracked.req.rid)
            self.send_outputs()
            return False
        return True

    def _add(self, msg: AddRequest) -> None:
        try:
            req = self.engine.make_request(msg.prompt_ids, msg.params)
            self.engine.scheduler.add(req)
        except DsctlError as exc:
            self.outbox.send(AddFailed(msg.rid, str(exc), user_error=True))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the engine down
            log.exception("adding request %s failed", msg.rid)
            self.outbox.send(AddFailed(msg.rid, f"internal error: {exc}", user_error=False))
            return
        self.active[msg.rid] = _Tracked(req)

    def step(self) -> None:
        if self.engine.scheduler.has_work():
            self.engine.scheduler.step()

    def send_outputs(self) -> None:
        """Send what every active request gained since the last call, and the stats."""
        outputs = []
        for rid, t in list(self.active.items()):
            out = self._diff(rid, t)
            if out is not None:
                outputs.append(out)
            if t.req.finished:
                del self.active[rid]
        stats = scheduler_stats(self.engine.scheduler, self.engine.runner)
        self.outbox.send(StepOutputs(outputs, stats))

    def _diff(self, rid: str, t: _Tracked) -> Optional[RequestOutput]:
        req, p = t.req, t.req.params
        new = list(req.output_ids[t.sent:])
        prompt_lp = None
        if p.prompt_logprobs and not t.prompt_sent and req.prompt_logprobs is not None:
            prompt_lp, t.prompt_sent = list(req.prompt_logprobs), True
        if not new and not req.finished and prompt_lp is None:
            return None
        out = RequestOutput(rid=rid, new_token_ids=new, prompt_logprobs=prompt_lp)
        if prompt_lp is not None:
            out.prompt_top_logprobs = getattr(req, "prompt_top_logprobs", None)
        if p.logprobs or p.top_logprobs:
            out.new_logprobs = list(req.output_logprobs[t.sent:t.sent + len(new)])
        if p.top_logprobs:
            out.new_top_logprobs = list(req.output_top_logprobs[t.sent:t.sent + len(new)])
        t.sent += len(new)
        if req.finished:
            out.finish_reason, out.matched_stop = req.finish_reason, req.matched_stop
            if isinstance(req.matched_stop, str):
                out.stop_text = req.text
        return out

    def run(self, inbox: Connection) -> None:
        while True:
            busy = self.engine.scheduler.has_work()
            got_any = False
            # Block while idle; never block while there is work to step.
            while inbox.poll(0 if busy or got_any else None):
                got_any = True
                if not self.handle(inbox.recv()):
                    return
            if busy or got_any:
                self.step()
                self.send_outputs()


def _warm_up(engine) -> None:
    """One short generation before reporting ready, so the first real request does not pay for lazy init."""
    from engine.sampling import SamplingParams

    vocab = engine.config.vocab_size
    engine.generate(input_ids=[[i % vocab for i in range(1, 9)]],
                    sampling_params=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))


def engine_main(args: EngineArgs, inbox: Connection, outbox: Connection) -> None:
    """Entry point of the spawned engine process."""
    # Ctrl-C and a SIGTERM sent to the whole process group are for the serving process to handle:
    # it aborts the requests and tells this process to stop (or this process sees the pipe close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        from engine.engine import Engine

        engine = Engine(args)
        _warm_up(engine)
    except BaseException as exc:  # noqa: BLE001 - report any startup failure to the server
        msg = str(exc) if isinstance(exc, DsctlError) else traceback.format_exc()
        outbox.send(EngineFailed(f"engine failed to start: {msg}"))
        sys.exit(1)
    runner = engine.runner
    outbox.send(EngineInfo(max_model_len=runner.max_model_len, vocab_size=engine.config.vocab_size,
                           kv_total_tokens=int(runner.kv_pool.size),
                           max_running_requests=args.max_running_requests, pid=os.getpid()))
    loop = EngineLoop(engine, outbox)
    try:
        loop.run(inbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the serving process is gone
    except BaseException:  # noqa: BLE001
        try:
            outbox.send(EngineFailed(f"engine process crashed:\n{traceback.format_exc()}"))
        finally:
            sys.exit(1)
