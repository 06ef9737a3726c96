"""`dsctl serve`: the OpenAI-compatible HTTP server (engine/server/). With no flags it serves `tiny`."""

from __future__ import annotations

import typer

from dsctl.flags import engine_command, engine_groups
from engine.args import EngineArgs


@engine_command(*engine_groups())
def serve(args: EngineArgs) -> None:
    if args.server.dry_run:  # the memory plan only: exit 0 when it fits, 2 when it does not
        from dsctl.plan_view import dry_run  # lazy: the memory plan's modules (~0.1 s); keeps dsctl --help fast

        return dry_run(args)
    from engine.server.serve import serve as run_server  # lazy: imports torch and uvicorn; keeps dsctl --help fast

    run_server(args)


def register(app: typer.Typer) -> None:
    app.command(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
             "/v1/models, /health, /metrics). Stops cleanly on SIGTERM.",
    )(serve)
