"""serve(args): run the OpenAI-compatible server in the foreground until SIGTERM / Ctrl-C.

The tokenizer is loaded here (the serving process); the model loads in the
engine process while the port is already open (/health answers 503 until it is
ready). SIGTERM stops accepting connections, lets in-flight requests finish for
up to --shutdown-timeout seconds, then aborts the rest (streams end with
finish_reason "abort" and [DONE]), stops the engine process and returns
normally, so the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket

from engine.args import EngineArgs
from engine.errors import DsctlError, UsageError


class EngineStartError(DsctlError):
    """The engine process could not load the model."""


ABORT_GRACE_S = 5.0  # after aborting, how long uvicorn waits for the aborted responses before cancelling them


def _uvicorn_server(config, on_first_exit):
    """A uvicorn.Server that calls on_first_exit() (from the signal handler) when the first SIGTERM/SIGINT arrives."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                on_first_exit()

    return Server(config)


def _abort_later(state, delay: float) -> None:
    """Thread-safe: after delay seconds, abort whatever the engine is still generating."""
    log = logging.getLogger("dsctl.server")

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
    import uvicorn

    from engine.resolve import resolve_model
    from engine.server.app import build_app
    from engine.tokenizer import load_tokenizer

    args.validate()
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    resolved = resolve_model(args)  # fail fast on a bad --model, before starting anything
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    app = build_app(args, tokenizer)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
                            access_log=args.log_level == "debug")
    sock = _bind(args.host, args.port)  # before the engine starts, so a busy port fails fast
    state = app.state.server
    server = _uvicorn_server(config, lambda: _abort_later(state, args.shutdown_timeout))
    state.request_exit = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; with this handler in place
    # that re-raise is a no-op and the process exits 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if state.exit_code:
        raise EngineStartError(state.client.dead_reason or "the engine process failed")
