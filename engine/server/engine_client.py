"""EngineClient: the serving process's handle on the engine process.

Starts the engine process (multiprocessing, spawn) with one pipe each way. A
sender thread writes requests to it so the event loop never blocks on a full
pipe; a reader thread receives its messages and hands them to the event loop,
which routes each request's outputs to the asyncio queue of the HTTP request
that owns it. If the engine process dies, every in-flight request gets an
`EngineDead` item at once and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass
from typing import Optional

from engine.args import EngineArgs
from engine.sampling import SamplingParams
from engine.server.protocol import (
    AbortRequest,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineStats,
    RequestOutput,
    Shutdown,
    StepOutputs,
)

log = logging.getLogger("dsctl.server")


@dataclass
class EngineDead:
    """Put on a request's queue when the engine process is gone."""

    message: str


class QueueFull(Exception):
    """More requests are waiting than --max-queued-requests allows."""


class EngineUnavailable(Exception):
    """The engine is still loading, or has died."""


@dataclass
class _Route:
    sink: asyncio.Queue
    tag: int


class EngineClient:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.info: Optional[EngineInfo] = None
        self.stats = EngineStats()
        self.dead_reason: Optional[str] = None
        self.startup_failed = False
        self.pending: set[str] = set()  # submitted, no output yet (waiting to be scheduled)
        self._routes: dict[str, _Route] = {}
        self._ids = itertools.count()
        self._outq: "queue.Queue" = queue.Queue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._proc = None
        self.ready: Optional[asyncio.Event] = None  # created in start(), on the running loop
        self.on_dead = None  # optional callback(startup: bool), called when the engine dies
        self._stopping = False

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        from engine.server.engine_process import engine_main

        self._loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        ctx = mp.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_main, args=(self.args, to_engine_r, from_engine_w),
                                 name="dsctl-engine", daemon=False)
        self._proc.start()
        to_engine_r.close()
        from_engine_w.close()
        self._conn_out, self._conn_in = to_engine_w, from_engine_r
        threading.Thread(target=self._send_loop, name="engine-sender", daemon=True).start()
        threading.Thread(target=self._recv_loop, name="engine-reader", daemon=True).start()
        log.info("engine process started (pid %d)", self._proc.pid)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.dead_reason is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to abort what is left and exit; kill it if it does not."""
        if self._proc is None:
            return
        self._stopping = True
        if self.info is None and self._proc.is_alive():
            self._proc.kill()  # still loading the model: nothing to drain
        elif self._proc.is_alive():
            self._outq.put(Shutdown())
        await asyncio.to_thread(self._proc.join, timeout)
        if self._proc.is_alive():
            log.warning("engine process did not exit in %.0fs; killing it", timeout)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        self._outq.put(None)
        self._fail_all("the server is shutting down")

    # ---- requests ------------------------------------------------------------
    def check_capacity(self, n: int) -> None:
        """Raise EngineUnavailable / QueueFull if n more sequences cannot be accepted now."""
        if self.dead_reason is not None:
            raise EngineUnavailable(f"the engine process is not running ({self.dead_reason.splitlines()[0]})")
        if self.info is None:
            raise EngineUnavailable("the engine is still loading the model")
        limit = self.args.max_queued_requests
        if limit is not None and len(self.pending) + n > limit:
            raise QueueFull(f"{len(self.pending)} requests are already waiting (--max-queued-requests {limit})")

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: asyncio.Queue, tag: int) -> str:
        """Send one sequence to the engine; its outputs arrive on sink as (tag, item)."""
        rid = f"r{next(self._ids)}"
        self._routes[rid] = _Route(sink, tag)
        self.pending.add(rid)
        self._outq.put(AddRequest(rid, list(prompt_ids), params))
        return rid

    def abort(self, rid: str) -> None:
        if self._routes.pop(rid, None) is not None:
            self.pending.discard(rid)
            if self.dead_reason is None:
                self._outq.put(AbortRequest(rid))

    def abort_all(self) -> int:
        """Abort every request in flight; each ends as an ordinary output with finish_reason 'abort'."""
        routes, self._routes = self._routes, {}
        self.pending.clear()
        for rid, route in routes.items():
            if self.dead_reason is None:
                self._outq.put(AbortRequest(rid))
            route.sink.put_nowait((route.tag, RequestOutput(rid, finish_reason="abort")))
        return len(routes)

    # ---- threads -------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._outq.get()
            if msg is None:
                return
            try:
                self._conn_out.send(msg)
            except (OSError, ValueError):
                return  # engine gone; the reader reports it

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._conn_in.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - a torn message from a dying process
                msg = EngineFailed(f"unreadable message from the engine process: {exc}")
            self._call(self._dispatch, msg)
            if isinstance(msg, EngineFailed):
                break
        self._proc.join(2)
        code = self._proc.exitcode
        self._call(self._died, f"the engine process exited (exit code {code})")

    def call_later(self, delay: float, fn) -> bool:
        """Thread-safe (signal handlers too): run fn() on the event loop after delay seconds.

        False when the client was never started (no event loop to run it on)."""
        if self._loop is None:
            return False
        self._call(self._loop.call_later, delay, fn)
        return True

    def _call(self, fn, *a) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *a)
        except RuntimeError:
            pass  # event loop closed: the server is exiting

    # ---- event-loop side -------------------------------------------------------
    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            self.stats = msg.stats
            for out in msg.outputs:
                self.pending.discard(out.rid)
                route = self._routes.get(out.rid)
                if route is not None:
                    route.sink.put_nowait((route.tag, out))
                    if out.finished:
                        del self._routes[out.rid]
        elif isinstance(msg, AddFailed):
            self.pending.discard(msg.rid)
            route = self._routes.pop(msg.rid, None)
            if route is not None:
                route.sink.put_nowait((route.tag, msg))
        elif isinstance(msg, EngineInfo):
            self.info = msg
            self.stats = EngineStats(kv_total_tokens=msg.kv_total_tokens, kv_free_tokens=msg.kv_total_tokens)
            self.ready.set()
            log.info("engine ready: context %d tokens, KV pool %d tokens", msg.max_model_len, msg.kv_total_tokens)
        elif isinstance(msg, EngineFailed):
            self._died(msg.message)

    def _died(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        startup = self.info is None
        if self._stopping:
            return
        log.error("%s", reason)
        self._fail_all(reason)
        self._outq.put(None)
        if self.on_dead is not None:
            self.on_dead(startup)

    def _fail_all(self, reason: str) -> None:
        routes, self._routes = self._routes, {}
        self.pending.clear()
        for route in routes.values():
            route.sink.put_nowait((route.tag, EngineDead(reason)))
