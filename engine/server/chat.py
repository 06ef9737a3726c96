"""POST /v1/chat/completions: messages rendered with the model's chat template; n choices; streaming.

With `--reasoning-parser deepseek-r1` (and the request's `separate_reasoning`,
default true) the `<think>` section goes to `reasoning_content`, in whole
responses and in streamed deltas alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server.errors import APIError, server_error
from engine.server.formatting import SSE_DONE, TokenText, chat_logprobs, new_id, now, sse
from engine.server.generation import Generation, Sequence
from engine.server.inputs import base_params, chat_prompt, check_prompt, choice_params, max_new_tokens
from engine.server.reasoning import ReasoningParser
from engine.server.schemas import ChatRequest, parse_body
from engine.server.state import ServerState, until_disconnect


@dataclass
class _Plan:
    req: ChatRequest
    gen: Generation
    reasoning: Optional[str]  # parser name, or None
    logprobs: bool


def _plan(state: ServerState, req: ChatRequest) -> _Plan:
    state.check_model(req.model)
    info = state.info()
    ids = chat_prompt(req, state.tokenizer)
    check_prompt(ids, info, param="messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mt = max_new_tokens(requested, len(ids), info,
                        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    base = base_params(req, info)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    base.logprobs, base.top_logprobs = bool(req.logprobs), req.top_logprobs or 0
    n = req.n or 1
    seqs = [Sequence(ids, choice_params(base, mt, req.seed, j), state.tokenizer) for j in range(n)]
    parser = state.args.reasoning_parser if req.separate_reasoning is not False else None
    return _Plan(req, Generation(state.client, seqs, state.metrics), parser, bool(req.logprobs))


def _message(plan: _Plan, seq: Sequence) -> dict:
    msg = {"role": "assistant", "content": seq.text}
    if plan.reasoning:
        reasoning, content = ReasoningParser(plan.reasoning).parse(seq.text)
        msg["content"], msg["reasoning_content"] = content or None, reasoning or None
    return msg


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), ChatRequest)
    plan = _plan(state, req)
    plan.gen.submit()
    rid, created = new_id("chatcmpl"), now()
    if req.stream:
        return StreamingResponse(_stream(state, plan, rid, created), media_type="text/event-stream")
    if not await until_disconnect(request, plan.gen.collect()):
        return Response(status_code=499)
    tok = TokenText(state.tokenizer)
    choices = [{"index": i, "message": _message(plan, s),
                "logprobs": chat_logprobs(s, tok, 0, len(s.output_ids)) if plan.logprobs else None,
                "finish_reason": s.finish_reason, "matched_stop": s.matched_stop}
               for i, s in enumerate(plan.gen.sequences)]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": plan.gen.usage})


async def _stream(state: ServerState, plan: _Plan, rid: str, created: int):
    tok = TokenText(state.tokenizer)
    seqs = plan.gen.sequences
    sent = [0] * len(seqs)
    parsers = [ReasoningParser(plan.reasoning) if plan.reasoning else None for _ in seqs]
    include_usage = bool(plan.req.stream_options and plan.req.stream_options.include_usage)

    def chunk(i: int, delta: dict, finish: Optional[str] = None, logprobs=None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        for i in range(len(seqs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, text, out in plan.gen.events():
            seq = seqs[i]
            delta = {}
            if parsers[i] is not None:
                reasoning, content = parsers[i].feed(text, final=out.finished)
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
            elif text:
                delta["content"] = text
            lp = None
            if plan.logprobs and len(seq.output_ids) > sent[i]:
                lp = chat_logprobs(seq, tok, sent[i], len(seq.output_ids))
                sent[i] = len(seq.output_ids)
            if delta or lp or out.finished:
                yield chunk(i, delta, seq.finish_reason if out.finished else None, lp)
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": state.model_name, "choices": [], "usage": plan.gen.usage})
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - end the stream with an error event, not a torn connection
        yield sse(server_error(f"internal error: {exc}").body())
    yield SSE_DONE
