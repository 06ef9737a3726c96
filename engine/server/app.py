"""The starlette application: routes, API-key check, JSON errors, engine lifecycle.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health (200 only while the engine is up, with the engine process's pid;
never needs the API key),
GET /metrics. Every error, including unknown routes and wrong methods, is an
OpenAI-style JSON body. The lifespan starts the engine process on startup and
stops it on shutdown.
"""

from __future__ import annotations

import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.args import EngineArgs
from engine.runtime.client import EngineClient
from engine.server.chat import chat_completions
from engine.server.completions import completions
from engine.server.errors import APIError, server_error
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.state import ServerState

log = logging.getLogger("dsctl.server")
OPEN_PATHS = ("/health",)


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.client.healthy:
        return JSONResponse({"status": "ok", "engine_pid": state.client.pid, "engine_pids": state.client.pids})
    try:
        state.info()
    except APIError as exc:
        return exc.response()
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dsctl",
            "root": state.model_root}
    if state.client.info is not None:
        card["max_model_len"] = state.client.info.max_model_len
    return JSONResponse({"object": "list", "data": [card]})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


class ApiKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every HTTP route except /health (pure ASGI, streaming-safe)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return server_error(f"internal error: {exc}").response()


def build_app(args: EngineArgs, tokenizer, client: EngineClient | None = None) -> Starlette:
    """The ASGI app; the engine process starts with the app's lifespan."""
    client = client or EngineClient(args)
    state = ServerState(args=args.server, client=client, tokenizer=tokenizer, metrics=ServerMetrics(client),
                        model_name=args.server.served_model_name or args.model.model, model_root=args.model.model)

    def on_dead(startup: bool) -> None:
        # The model never loaded, or a rank died (its requests already got errors): nothing left to
        # serve with. Exit non-zero so that a supervisor (systemd, Kubernetes) restarts the server.
        state.exit_code = 1
        if state.request_exit is not None:
            state.request_exit()

    client.on_dead = on_dead

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start()
        try:
            yield
        finally:
            await client.shutdown(timeout=30)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.server = state
    if args.server.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.server.api_key)
    return app
