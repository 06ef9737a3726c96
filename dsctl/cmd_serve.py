"""`dsctl serve`: the OpenAI-compatible HTTP server (engine/server/). With no flags it serves `tiny`."""

from __future__ import annotations

import typer

from dsctl.flags import engine_command
from engine.args import GPU, MODEL, SERVER, EngineArgs


@engine_command(MODEL, SERVER, GPU)
def serve(args: EngineArgs) -> None:
    from engine.server.serve import serve as run_server

    run_server(args)


def register(app: typer.Typer) -> None:
    app.command(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
             "/v1/models, /health, /metrics). Stops cleanly on SIGTERM.",
    )(serve)
