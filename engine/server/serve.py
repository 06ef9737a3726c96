"""serve(args): run the OpenAI-compatible server in the foreground until SIGTERM / Ctrl-C.

The tokenizer is loaded here (the serving process); the model loads in the
engine process while the port is already open (/health answers 503 until it is
ready). SIGTERM stops accepting connections, lets in-flight requests finish for
up to --shutdown-timeout seconds, then aborts the rest (streams end with
finish_reason "abort" and [DONE]), stops the engine ranks and returns
normally, so the process exits 0.

On a node other than 0 (--nnodes N --node-rank R > 0) there is no HTTP side: this node's
engine ranks run alone (engine/runtime/node_ranks.py).
"""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from engine.args import EngineArgs
from engine.checkpoint.tokenizer import load_tokenizer
from engine.errors import DsctlError, UsageError
from engine.runtime.launch_checks import check_launch, launch_args
from engine.runtime.node_ranks import serve_ranks_only
from engine.server.app import build_app

log = logging.getLogger("dsctl.server")


class EngineStartError(DsctlError):
    """The engine process could not load the model."""


class EngineDied(DsctlError):
    """An engine rank died while serving; the server exits non-zero (its requests got errors)."""


ABORT_GRACE_S = 5.0  # after aborting, how long uvicorn waits for the aborted responses before cancelling them


def _uvicorn_server(config, on_first_exit):
    """A uvicorn.Server that calls on_first_exit() (from the signal handler) when the first SIGTERM/SIGINT arrives."""
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                on_first_exit()

    return Server(config)


def _abort_later(state, delay: float) -> None:
    """Thread-safe: after delay seconds, abort whatever the engine is still generating."""
    def abort() -> None:
        n = state.client.abort_all()
        if n:
            log.warning("shutting down: aborted %d request(s) still running after %.0fs", n, delay)

    if state.client.call_later(delay, abort):
        log.info("shutting down: no new connections; in-flight requests get %.0fs to finish", delay)


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
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    app = build_app(args, tokenizer)
    config = uvicorn.Config(app, host=http.host, port=http.port, log_level=http.log_level,
                            timeout_graceful_shutdown=http.shutdown_timeout + ABORT_GRACE_S,
                            access_log=http.log_level == "debug")
    sock = _bind(http.host, http.port)  # before the engine starts, so a busy port fails fast
    state = app.state.server
    server = _uvicorn_server(config, lambda: _abort_later(state, http.shutdown_timeout))
    state.request_exit = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; with this handler in place
    # that re-raise is a no-op and the process exits 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if state.exit_code:
        reason = state.client.dead_reason or "the engine process failed"
        raise (EngineStartError if state.client.info is None else EngineDied)(reason)

