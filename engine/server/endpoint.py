"""The request -> response skeleton that /v1/completions and /v1/chat/completions share.

A route describes itself with an `Endpoint`: its body schema, id prefix and
object names, how to plan the generation (`plan(state, body)` returns an object
with `.gen`, a Generation), the choices of a whole response, and the choice
chunks of a stream. `respond` does the rest the same way for both: read the
body (within the limits of limits.py), parse and plan it in a worker thread
(anything wrong with it is a 4xx), submit, then either wait for the whole
response (499 when the client leaves first) or stream; every body carries id /
object / created / model, and
a stream with `stream_options.include_usage` ends with a usage chunk; a stream
that fails ends with an error event; every stream ends with [DONE].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server.errors import APIError, bad_request, server_error
from engine.server.formatting import SSE_DONE, new_id, now, sse, sse_chunks
from engine.server.limits import ClientGone, check_prompt_tokens, check_sequences, decode_json, read_body
from engine.server.schemas import validate_body
from engine.server.state import ServerState, until_disconnect

log = logging.getLogger("dsctl.server")

ChunkFn = Callable[[list[dict]], str]  # choices -> one SSE chunk


@dataclass
class Endpoint:
    schema: type
    id_prefix: str  # "cmpl", "chatcmpl"
    object_name: str  # of a whole response
    chunk_object: str  # of a streamed chunk
    plan: Callable[[ServerState, Any], Any]  # (state, body) -> plan with .gen
    choices: Callable[[ServerState, Any], list[dict]]  # (state, plan) -> choices, once generation is done
    chunks: Callable[[ServerState, Any, ChunkFn], AsyncIterator[str]]  # (state, plan, chunk) -> SSE chunks


@dataclass
class _Frame:
    """The fields every body of one response repeats."""

    rid: str
    created: int
    model: str

    def body(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


async def respond(request: Request, ep: Endpoint) -> Response:
    state: ServerState = request.app.state.server
    state.check_accepting()
    try:
        raw = await read_body(request, state.limits.max_body_bytes)
    except ClientGone:
        return Response(status_code=499)
    # JSON, validation, tokenising and the chat template run in a worker thread: a huge prompt
    # must not stall /health or the streams of other requests.
    body, plan = await run_in_threadpool(_prepare, state, ep, raw)
    state.check_accepting()  # a shutdown may have begun while the request was prepared
    plan.gen.submit()
    frame = _Frame(new_id(ep.id_prefix), now(), state.model_name)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(ep, state, plan, frame, usage), media_type="text/event-stream")
    if not await until_disconnect(request, plan.gen.collect()):
        return Response(status_code=499)
    return JSONResponse(frame.body(ep.object_name, ep.choices(state, plan), usage=plan.gen.usage))


def _prepare(state: ServerState, ep: Endpoint, raw: bytes) -> tuple[Any, Any]:
    """(validated body, plan) from the raw body; every problem is a 4xx APIError (a worker thread runs this)."""
    limits = state.limits
    try:
        body = validate_body(decode_json(raw, limits.max_json_depth), ep.schema)
        check_sequences(body, limits.max_sequences)
        plan = ep.plan(state, body)
        check_prompt_tokens(plan.gen.usage["prompt_tokens"], limits.max_prompt_tokens,
                            "messages" if hasattr(body, "messages") else "prompt")
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - a request must never turn into a 500 while it is being checked
        log.exception("unexpected error while checking a request")
        raise bad_request(f"the request could not be processed: {type(exc).__name__}: {exc}",
                          code="invalid_request") from None
    return body, plan


async def _stream(ep: Endpoint, state: ServerState, plan, frame: _Frame, include_usage: bool):
    extra = {"usage": None} if include_usage else {}
    chunk = sse_chunks(frame.body(ep.chunk_object, [], **extra))

    try:
        async for piece in ep.chunks(state, plan, chunk):
            yield piece
        if include_usage:
            yield sse(frame.body(ep.chunk_object, [], usage=plan.gen.usage))
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - end the stream with an error event, not a torn connection
        yield sse(server_error(f"internal error: {exc}").body())
    yield SSE_DONE
