"""serve(args): run the OpenAI-compatible server in the foreground until SIGTERM / Ctrl-C.

The tokenizer is loaded here (the serving process); the model loads in the
engine process while the port is already open (/health answers 503 until it is
ready). SIGTERM stops accepting connections, lets in-flight requests finish for
up to --shutdown-timeout seconds, then aborts the rest (streams end with
finish_reason "abort" and [DONE]), stops the engine ranks and returns
normally, so the process exits 0.

On a node other than 0 (--nnodes N --node-rank R > 0) there is no HTTP side: this node's
engine ranks join node 0's world and run until node 0 stops them (or one fails, which
ends the process non-zero with the rank's error).
"""

from __future__ import annotations

import logging
import signal
import socket

from engine.args import EngineArgs
from engine.errors import DsctlError, UsageError


class EngineStartError(DsctlError):
    """The engine process could not load the model."""


class EngineDied(DsctlError):
    """An engine rank died while serving; the server exits non-zero (its requests got errors)."""


class EngineRanksFailed(DsctlError):
    """An engine rank of this node failed."""


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

    from engine.ranked import check_launch, launch_args
    from engine.server.app import build_app
    from engine.tokenizer import load_tokenizer

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


def serve_ranks_only(args: EngineArgs) -> None:
    """Node R > 0 of a multi-node job: run this node's ranks until they exit; SIGTERM stops them."""
    from engine.distributed.launch import start_ranks
    from engine.server.engine_process import engine_main

    log = logging.getLogger("dsctl.server")
    pc = args.parallel.config()
    ranks = start_ranks(engine_main, pc.ranks_per_node, (args, None, None), first_rank=pc.global_rank(0))
    log.info("node %d: engine ranks %d..%d started (pids %s), joining %s", pc.node_rank, pc.global_rank(0),
             pc.global_rank(pc.ranks_per_node - 1), ranks.pids, pc.dist_init_addr)
    stopping: list[int] = []

    def on_sigterm(*_) -> None:
        stopping.append(1)
        ranks.stop(grace=2.0)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        failure = ranks.wait()
    except KeyboardInterrupt:
        ranks.stop()
        return
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failure is not None and not stopping:
        raise EngineRanksFailed(f"engine {failure.message()}")
