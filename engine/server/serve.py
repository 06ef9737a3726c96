"""serve(args): run the OpenAI-compatible server in the foreground until SIGTERM / Ctrl-C.

The tokenizer is loaded here (the serving process); the model loads in the
engine process while the port is already open (/health answers 503 until it is
ready, and the URL is logged once it is). The first SIGTERM or SIGINT (Ctrl-C)
stops accepting connections and requests (503), lets in-flight requests finish
for up to --graceful-shutdown-timeout seconds, then aborts the rest (streams end
with finish_reason "abort" and [DONE]), stops the engine ranks and returns
normally: the process exits 0. A second signal aborts what is left at once (the
streams still end the same way) and stops the ranks without waiting for them;
the process exits 0 too. When the engine dies the process exits 2 (EngineDied),
so that a supervisor restarts it.

On a node other than 0 (--nnodes N --node-rank R > 0) there is no HTTP side: this node's
engine ranks run alone (engine/runtime/node_ranks.py).
"""

from __future__ import annotations

import logging
import socket
import time

import uvicorn

from engine.args import EngineArgs
from engine.checkpoint.tokenizer import load_tokenizer
from engine.errors import DsctlError, UsageError
from engine.runtime.client import EngineClient
from engine.runtime.heap import freeze_startup_heap, warn_slow_collections
from engine.runtime.launch_checks import check_launch, launch_args
from engine.runtime.node_ranks import serve_ranks_only
from engine.runtime.process_clock import process_age_s
from engine.server.app import build_app

log = logging.getLogger("dsctl.server")


class EngineStartError(DsctlError):
    """The engine process could not load the model."""


class EngineDied(DsctlError):
    """An engine rank died while serving; the server exits non-zero (its requests got errors)."""


ABORT_GRACE_S = 2.0  # after aborting, how long uvicorn waits for the aborted responses before cancelling them


class _Shutdown:
    """What the first and the second SIGTERM / SIGINT do (called from the signal handler, on the loop's thread)."""

    def __init__(self, state, timeout: float):
        self.state, self.timeout = state, timeout

    def first(self) -> None:
        self.state.draining = True
        if self.state.client.call_later(self.timeout, lambda: self._abort(f"still running after {self.timeout:.0f}s")):
            log.info("shutting down: no new requests; in-flight requests get %.0fs to finish (a second SIGTERM / "
                     "Ctrl-C ends them now)", self.timeout)

    def second(self) -> None:
        self.state.forced = True
        self.state.client.call_later(0, lambda: self._abort("on a second signal"))

    def _abort(self, why: str) -> None:
        n = self.state.client.abort_all()
        if n:
            log.warning("shutting down: aborted %d request(s) %s", n, why)


def _uvicorn_server(config, shutdown: _Shutdown) -> uvicorn.Server:
    """A uvicorn.Server whose signal handling is ours: the first signal drains, the second aborts at once.

    Neither re-raises the signal afterwards (uvicorn's own handler does, which made Ctrl-C exit 130), and
    neither sets uvicorn's force_exit, which skips the engine's shutdown and cancels streams mid-write."""
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                shutdown.second()
                return
            self.should_exit = True
            shutdown.first()

    return Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def _log_startup(launched_after, after_launch: float) -> None:
    before = "" if launched_after is None else f"engine ranks launched {launched_after:.1f} s after the process " \
        "started (Python, imports, checks), then "
    log.info("server start-up: %s%.1f s for the tokenizer and the app while the ranks start", before, after_launch)


def serve(args: EngineArgs) -> None:
    args.validate()
    http = args.server
    level = http.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = launch_args(args)  # --enable-dp-attention alone spans the visible GPUs
    resolved = check_launch(args)  # fail fast on a bad --model or parallel layout, before starting anything
    if args.parallel.node_rank > 0:
        serve_ranks_only(args)
        return
    launched_after = process_age_s()
    sock = _bind(http.host, http.port)  # before the engine starts, so a busy port fails fast
    client = EngineClient(args)
    launching = time.perf_counter()
    client.launch()  # the ranks start up while this process loads the tokenizer and starts the HTTP server
    try:
        tokenizer = load_tokenizer(resolved.tokenizer_path)
        app = build_app(args, tokenizer, client)
    except BaseException:
        client.stop_launched()
        sock.close()
        raise
    _log_startup(launched_after, time.perf_counter() - launching)
    freeze_startup_heap("server")  # imports, tokenizer and app (the ranks freeze theirs once warmed up)
    warn_slow_collections("server")
    config = uvicorn.Config(app, host=http.host, port=http.port, log_level=http.log_level,
                            timeout_graceful_shutdown=http.graceful_shutdown_timeout + ABORT_GRACE_S,
                            access_log=http.log_level == "debug")
    state = app.state.server
    server = _uvicorn_server(config, _Shutdown(state, http.graceful_shutdown_timeout))
    state.request_exit = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    finally:
        client.stop_launched()  # uvicorn never reached the app's lifespan (which owns the ranks from then on)
    if state.exit_code:
        reason = state.client.dead_reason or "the engine process failed"
        raise (EngineStartError if state.client.info is None else EngineDied)(reason)
