"""EngineClient: the serving process's handle on the engine's rank processes (async, for the HTTP server).

Starts this node's engine ranks (`EngineRanks.start_engine`: one spawned process per GPU
rank, one in all for --tp 1, with one pipe each way to rank 0). A sender thread writes
requests to rank 0 so the event loop never blocks on a full pipe; a reader thread receives
its messages (`EngineRanks.receive`) and hands them to the event loop, which routes each
request's outputs to the Inbox of the HTTP request that owns it. If any rank dies
(killed, OOM, exception), the others are stopped, every in-flight request gets an
`EngineDead` item at once naming the rank and its error, and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Optional

from engine.args import EngineArgs
from engine.grammar.spec import GrammarSpec
from engine.runtime.protocol import (
    AbortRequest,
    AddFailed,
    AddRequest,
    EngineInfo,
    EngineStats,
    ExpertLoadUpdate,
    ProfileWritten,
    ReportExpertLoad,
    RequestOutput,
    StartProfile,
    StepOutputs,
    StopProfile,
)
from engine.runtime.ranks import EngineRankError, EngineRanks
from engine.sampling import SamplingParams

log = logging.getLogger("dsctl.server")


@dataclass
class EngineDead:
    """Put on a request's queue when the engine process is gone."""

    message: str


class QueueFull(Exception):
    """More requests are waiting than --max-queued-requests allows."""


class EngineUnavailable(Exception):
    """The engine is still loading, or has died."""


class Inbox:
    """Where the event loop leaves what the engine sent one HTTP request, which takes it all at once.

    An asyncio.Queue per request did the same with more work per item (its waiter deque, size checks and one
    get per item) on the path every streamed token takes. Event-loop only, unbounded."""

    __slots__ = ("items", "_waiter")

    def __init__(self):
        self.items: list = []
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        """Everything left since the last take, in order; waits for at least one item."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


@dataclass
class _Route:
    sink: Inbox
    tag: int


class EngineClient:
    def __init__(self, args: EngineArgs, rank_main=None):
        """`rank_main`: what each rank process runs (default rank_loop.engine_main; tests pass a
        picklable wrapper of it)."""
        self.args = args
        self._rank_main = rank_main
        self.info: Optional[EngineInfo] = None
        self.stats = EngineStats()
        self.expert_load: Optional[ExpertLoadUpdate] = None  # the latest routing counts (--record-expert-load)
        self._load_waiters: list[asyncio.Future] = []
        self.profiling: Optional[str] = None  # the stamp of the profile the ranks are recording (POST /start_profile)
        self.last_profile: Optional[ProfileWritten] = None  # one that stopped by itself (its steps run), not yet asked for
        self._profile_waiter: Optional[asyncio.Future] = None
        self.dead_reason: Optional[str] = None
        self.startup_failed = False
        self.pending: set[str] = set()  # submitted, no output yet (waiting to be scheduled)
        self._routes: dict[str, _Route] = {}
        self._ids = itertools.count()
        self._outq: "queue.Queue" = queue.Queue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ranks: Optional[EngineRanks] = None
        self.ready: Optional[asyncio.Event] = None  # created in start(), on the running loop
        self.on_dead = None  # optional callback(startup: bool), called when the engine dies
        self._stopping = False

    # ---- lifecycle -----------------------------------------------------------
    def launch(self) -> None:
        """Spawn the engine ranks now (idempotent): the serving process calls this before it loads the tokenizer
        and starts the HTTP server, so the ranks start up meanwhile; their messages wait in the pipe for
        `start`."""
        if self._ranks is None:
            self._ranks = EngineRanks.start_engine(self.args, self._rank_main)
            log.info("engine started: %d rank process(es), pids %s", len(self._ranks.pids), self._ranks.pids)

    def stop_launched(self) -> None:
        """Stop ranks that `launch` spawned when the server never started (`start` was not called)."""
        if self._ranks is not None and self._loop is None:
            self._ranks.stop(grace=1.0)

    def start(self) -> None:
        """On the server's event loop: launch the ranks (unless `launch` did) and start the pipe threads."""
        self._loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.launch()
        threading.Thread(target=self._send_loop, name="engine-sender", daemon=True).start()
        threading.Thread(target=self._recv_loop, name="engine-reader", daemon=True).start()

    @property
    def pid(self) -> Optional[int]:
        """Rank 0's process id."""
        return self._ranks.pids[0] if self._ranks else None

    @property
    def pids(self) -> list[int]:
        return list(self._ranks.pids) if self._ranks else []

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.dead_reason is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine ranks to abort what is left and exit; stop them if they do not in `timeout` s."""
        if self._ranks is None:
            return
        self._stopping = True
        if self.info is None:
            self._ranks.stop(grace=1.0)  # still loading the model: nothing to drain
        else:
            await asyncio.to_thread(self._ranks.shutdown, timeout)
        self._outq.put(None)
        self._fail_all("the server is shutting down")

    # ---- requests ------------------------------------------------------------
    def check_capacity(self, n: int) -> None:
        """Raise EngineUnavailable / QueueFull if n more sequences cannot be accepted now."""
        if self.dead_reason is not None:
            raise EngineUnavailable(f"the engine process is not running ({self.dead_reason.splitlines()[0]})")
        if self.info is None:
            raise EngineUnavailable("the engine is still loading the model")
        limit = self.args.server.max_queued_requests
        if limit and len(self.pending) + n > limit:  # 0: unbounded
            raise QueueFull(f"{len(self.pending)} requests are already waiting (--max-queued-requests {limit})")

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Inbox, tag: int,
               grammar: Optional[GrammarSpec] = None) -> str:
        """Send one sequence to the engine (its output constrained by `grammar`, if given); its outputs arrive
        on sink as (tag, item)."""
        rid = f"r{next(self._ids)}"
        self._routes[rid] = _Route(sink, tag)
        self.pending.add(rid)
        self._outq.put(AddRequest(rid, list(prompt_ids), params, grammar=grammar))
        return rid

    async def fetch_expert_load(self, timeout: float = 30.0) -> ExpertLoadUpdate:
        """Ask the ranks for their routing counts now and wait for them (they answer between steps). Requests
        that arrive while one is pending wait for the same answer: each ask is a collective over every rank
        between two steps, so a burst of requests costs the engine one."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not serving")
        self._load_waiters = [w for w in self._load_waiters if not w.done()]  # timed out ones are done
        if not self._load_waiters:
            self._outq.put(ReportExpertLoad())
        waiter = self._loop.create_future()
        self._load_waiters.append(waiter)
        return await asyncio.wait_for(waiter, timeout)

    def start_profile(self, stamp: str, max_steps: int) -> None:
        """Tell every rank to start recording a profile (between two steps) of at most `max_steps` engine steps;
        the caller checks `profiling`."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not serving")
        self.profiling, self.last_profile = stamp, None
        self._outq.put(StartProfile(stamp, max_steps))

    async def stop_profile(self, timeout: float = 120.0) -> Optional[ProfileWritten]:
        """Tell every rank to stop and write its profile; wait for their summaries (writing a long trace takes
        seconds). None recording: the one that stopped by itself since (given once), else None."""
        if self.profiling is None:
            done, self.last_profile = self.last_profile, None
            return done
        if not self.healthy:
            raise EngineUnavailable("the engine is not serving")
        self.profiling = None
        if self._profile_waiter is None or self._profile_waiter.done():
            self._profile_waiter = self._loop.create_future()
            self._outq.put(StopProfile())
        return await asyncio.wait_for(asyncio.shield(self._profile_waiter), timeout)

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
                self._ranks.send(msg)
            except (OSError, ValueError):
                return  # engine gone; the reader reports it

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._ranks.receive()
            except EngineRankError as exc:
                self._call(self._died, str(exc))
                return
            self._call(self._dispatch, msg)

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
        elif isinstance(msg, ExpertLoadUpdate):
            self.expert_load = msg
            waiters, self._load_waiters = self._load_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(msg)
        elif isinstance(msg, ProfileWritten):
            if self._profile_waiter is not None and not self._profile_waiter.done():
                self._profile_waiter.set_result(msg)
            else:  # it ran its steps and stopped by itself: kept for the next POST /stop_profile
                self.last_profile = msg
                if self.profiling == msg.stamp:
                    self.profiling = None
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
