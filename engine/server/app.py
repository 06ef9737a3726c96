"""The starlette application: routes, API-key check, JSON errors, engine lifecycle.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics, GET /expert_load (with --record-expert-load), POST /start_profile and POST /stop_profile
(with --profile-dir). With an API key set every route needs it, except
/health, which without the key says only `{"status": "ok"}` (200) or
`{"status": "not ready"}` (503); with the key (or when no key is set) it also
names the engine's pids, or says why it is not ready. Every error, including
unknown routes and wrong methods, is an OpenAI-style JSON body. The lifespan
starts the engine process on startup (and logs the URL once the engine is
ready) and stops it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.args import EngineArgs, ServerArgs
from engine.runtime.client import EngineClient, EngineUnavailable
from engine.runtime.profiling import profile_stamp
from engine.server.auth import ApiKeyMiddleware, authorised
from engine.server.chat import chat_completions
from engine.server.completions import completions
from engine.server.errors import APIError, server_error, unavailable
from engine.server.limits import ClientGone, Limits, decode_json, read_body
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.schemas import ProfileRequest, validate_body
from engine.server.state import ServerState

log = logging.getLogger("dsctl.server")
ENGINE_EXIT_S = 5.0  # after the HTTP side has drained: how long the ranks get to exit before they are stopped
FORCED_ENGINE_EXIT_S = 1.0  # the same after a second SIGTERM / Ctrl-C


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ready = state.client.healthy and not state.draining
    if not authorised(request.scope.get("headers"), state.api_key):
        return JSONResponse({"status": "ok" if ready else "not ready"}, status_code=200 if ready else 503)
    if ready:
        return JSONResponse({"status": "ok", "engine_pid": state.client.pid, "engine_pids": state.client.pids})
    try:
        state.check_accepting()
        state.info()
    except APIError as exc:
        return exc.response()
    return JSONResponse({"status": "unavailable"}, status_code=503)


def listen_url(args: ServerArgs) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


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


async def expert_load(request: Request) -> Response:
    """GET /expert_load: the routing counts per MoE layer, per logical expert and per EP rank, since the engine
    became ready (--record-expert-load); what `dsctl place-experts --load` reads."""
    state: ServerState = request.app.state.server
    if not state.client.args.parallel.record_expert_load:
        raise APIError(404, "routing counts are not recorded: start the server with --record-expert-load",
                       "not_found_error")
    state.check_accepting()
    try:
        update = await state.client.fetch_expert_load()
    except (asyncio.TimeoutError, EngineUnavailable) as exc:
        raise unavailable(f"the engine did not send its routing counts: {exc or 'timed out'}") from None
    return JSONResponse(update.report.to_json())


def _profiling(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.client.args.server.profile_dir:
        raise APIError(404, "profiling is off: start the server with --profile-dir DIR", "not_found_error")
    state.check_accepting()
    return state


async def start_profile(request: Request) -> Response:
    """POST /start_profile [{"num_steps": N}]: every rank records a torch.profiler profile of N engine steps
    (schemas.ProfileRequest), or until POST /stop_profile."""
    state = _profiling(request)
    try:
        raw = await read_body(request, state.limits.max_body_bytes)
    except ClientGone:
        return Response(status_code=499)
    body = decode_json(raw, state.limits.max_json_depth) if raw.strip() else {}
    steps = validate_body(body, ProfileRequest).num_steps
    if state.client.profiling is not None:
        raise APIError(400, f"a profile ({state.client.profiling}) is already being recorded: POST /stop_profile "
                       "first", "invalid_request_error")
    stamp = profile_stamp()
    try:
        state.client.start_profile(stamp, steps)
    except EngineUnavailable as exc:
        raise unavailable(str(exc)) from None
    return JSONResponse({"profile": stamp, "num_steps": steps, "directory": state.client.args.server.profile_dir})


async def stop_profile(request: Request) -> Response:
    """POST /stop_profile: every rank writes its trace; the answer lists them with each rank's communication
    time (engine/runtime/profiling.py). A profile that already ran its steps: that one, once."""
    state = _profiling(request)
    try:
        written = await state.client.stop_profile()
    except (asyncio.TimeoutError, EngineUnavailable) as exc:
        raise unavailable(f"the engine did not write its profile: {exc or 'timed out'}") from None
    if written is None:
        raise APIError(400, "no profile is being recorded: POST /start_profile first", "invalid_request_error")
    return JSONResponse({"profile": written.stamp, "ranks": written.ranks,
                         "stopped": "num_steps reached" if written.ran_its_steps else "on request"})


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
                        model_name=args.server.served_model_name or args.model.model, model_root=args.model.model,
                        limits=Limits.of(args.server), api_key=args.server.key())

    def on_dead(startup: bool) -> None:
        # The model never loaded, or a rank died (its requests already got errors): nothing left to
        # serve with. Exit non-zero so that a supervisor (systemd, Kubernetes) restarts the server.
        state.exit_code = 1
        if state.request_exit is not None:
            state.request_exit()

    client.on_dead = on_dead

    async def announce() -> None:
        await client.ready.wait()
        log.info("ready: serving %s at %s (OpenAI API under /v1)", state.model_name, listen_url(args.server))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start()
        ready = asyncio.ensure_future(announce())
        try:
            yield
        finally:
            ready.cancel()
            await client.shutdown(timeout=FORCED_ENGINE_EXIT_S if state.forced else ENGINE_EXIT_S)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/expert_load", expert_load, methods=["GET"]),
        Route("/start_profile", start_profile, methods=["POST"]),
        Route("/stop_profile", stop_profile, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.server = state
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    return app
