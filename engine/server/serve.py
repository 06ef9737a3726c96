"""serve(args): run the OpenAI-compatible server in the foreground until SIGTERM / Ctrl-C.

The tokenizer is loaded here (the serving process); the model loads in the
engine process while the port is already open (/health answers 503 until it is
ready). SIGTERM stops accepting connections, lets in-flight requests finish for
up to --shutdown-timeout seconds (then aborts them), stops the engine process
and returns normally, so the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket

from engine.args import EngineArgs
from engine.errors import DsctlError, UsageError


class EngineStartError(DsctlError):
    """The engine process could not load the model."""


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
    tokenizer = load_tokenizer(resolved.path)
    app = build_app(args, tokenizer)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug")
    sock = _bind(args.host, args.port)  # before the engine starts, so a busy port fails fast
    server = uvicorn.Server(config)
    state = app.state.server
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
