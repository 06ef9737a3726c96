"""The engine process: owns the Engine (scheduler + model) and runs the forward loop.

It is started by the serving process (multiprocessing, spawn) with two pipes. The
loop drains incoming messages (add / abort / shutdown), runs `scheduler.step()`
while there is work, and after each step sends the deltas the scheduler's output
processor gathered (`RequestOutput`: new tokens, log-probs, finishes; the same
deltas the offline Engine collects) with the scheduler's load and KV statistics.
Requests carry the serving process's ids, so deltas go out as they are.
When idle it blocks on the inbox; when the serving process goes away (pipe EOF)
it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from engine.args import EngineArgs
from engine.errors import DsctlError
from engine.server import protocol

log = logging.getLogger("dsctl.engine")


def scheduler_stats(scheduler, runner) -> protocol.EngineStats:
    """Load, memory and prefix-cache figures."""
    pool, extra = runner.kv_pool, scheduler.stats()
    running = len(scheduler.running) + extra["prefilling"]  # + a chunked prefill in progress
    return protocol.EngineStats(running=running, waiting=len(scheduler.waiting), kv_total_tokens=int(pool.size),
                                kv_free_tokens=int(pool.available()),
                                prefix_cache_tokens=extra["prefix_cache_tokens"],
                                prefix_cache_hit_rate=extra["prefix_cache_hit_rate"])


class EngineLoop:
    """Message handling around one Engine; sends the scheduler's deltas after every step."""

    def __init__(self, engine, outbox: Connection):
        self.engine = engine
        self.outbox = outbox

    def handle(self, msg) -> bool:
        """Apply one message; False when the loop should stop."""
        if isinstance(msg, protocol.AddRequest):
            self._add(msg)
        elif isinstance(msg, protocol.AbortRequest):
            self.engine.scheduler.abort(msg.rid)
        elif isinstance(msg, protocol.Shutdown):
            self.engine.scheduler.abort_all()
            self.send_outputs()
            return False
        return True

    def _add(self, msg: protocol.AddRequest) -> None:
        try:
            req = self.engine.make_request(msg.prompt_ids, msg.params, rid=msg.rid)
            self.engine.scheduler.add(req)
        except DsctlError as exc:
            self.outbox.send(protocol.AddFailed(msg.rid, str(exc), user_error=True))
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the engine down
            log.exception("adding request %s failed", msg.rid)
            self.outbox.send(protocol.AddFailed(msg.rid, f"internal error: {exc}", user_error=False))

    def step(self) -> None:
        if self.engine.scheduler.has_work():
            self.engine.scheduler.step()

    def send_outputs(self) -> None:
        """Send the deltas gathered since the last call, and the stats."""
        outputs = self.engine.scheduler.take_outputs()
        stats = scheduler_stats(self.engine.scheduler, self.engine.runner)
        self.outbox.send(protocol.StepOutputs(outputs, stats))

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
        outbox.send(protocol.EngineFailed(f"engine failed to start: {msg}"))
        sys.exit(1)
    runner = engine.runner
    outbox.send(protocol.EngineInfo(max_model_len=runner.max_model_len, vocab_size=engine.config.vocab_size,
                           kv_total_tokens=int(runner.kv_pool.size),
                           max_running_requests=args.max_running_requests, pid=os.getpid()))
    loop = EngineLoop(engine, outbox)
    try:
        loop.run(inbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the serving process is gone
    except BaseException:  # noqa: BLE001
        try:
            outbox.send(protocol.EngineFailed(f"engine process crashed:\n{traceback.format_exc()}"))
        finally:
            sys.exit(1)
