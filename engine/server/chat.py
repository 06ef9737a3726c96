"""POST /v1/chat/completions: messages rendered with the model's chat template; n choices; streaming.

With `--reasoning-parser deepseek-r1` (and the request's `separate_reasoning`,
default true) the `<think>` section goes to `reasoning_content`, in whole
responses and in streamed deltas alike. The request/response skeleton (parse,
submit, wait or stream, framing) is endpoint.py's, shared with /v1/completions;
this module plans the generation and shapes the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from engine.server.endpoint import ChunkFn, Endpoint, respond
from engine.server.errors import APIError
from engine.server.formatting import TokenText, chat_logprobs
from engine.server.generation import Generation, Sequence
from engine.server.inputs import base_params, chat_prompt, check_prompt, choice_params, max_new_tokens
from engine.server.reasoning import ReasoningParser
from engine.server.schemas import ChatRequest
from engine.server.state import ServerState


@dataclass
class _Plan:
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
    return _Plan(Generation(state.client, seqs, state.metrics), parser, bool(req.logprobs))


def _message(plan: _Plan, seq: Sequence) -> dict:
    msg = {"role": "assistant", "content": seq.text}
    if plan.reasoning:
        reasoning, content = ReasoningParser(plan.reasoning).parse(seq.text)
        msg["content"], msg["reasoning_content"] = content or None, reasoning or None
    return msg


def _choices(state: ServerState, plan: _Plan) -> list[dict]:
    tok = TokenText(state.tokenizer)
    return [{"index": i, "message": _message(plan, s),
             "logprobs": chat_logprobs(s, tok, 0, len(s.output_ids)) if plan.logprobs else None,
             "finish_reason": s.finish_reason, "matched_stop": s.matched_stop}
            for i, s in enumerate(plan.gen.sequences)]


async def _chunks(state: ServerState, plan: _Plan, chunk: ChunkFn):
    tok = TokenText(state.tokenizer)
    seqs = plan.gen.sequences
    sent = [0] * len(seqs)
    parsers = [ReasoningParser(plan.reasoning) if plan.reasoning else None for _ in seqs]

    def choice(i: int, delta: dict, finish: Optional[str] = None, logprobs=None) -> str:
        return chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    for i in range(len(seqs)):
        yield choice(i, {"role": "assistant", "content": ""})
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
            yield choice(i, delta, seq.finish_reason if out.finished else None, lp)


CHAT = Endpoint(ChatRequest, "chatcmpl", "chat.completion", "chat.completion.chunk", _plan, _choices, _chunks)


async def chat_completions(request: Request) -> Response:
    return await respond(request, CHAT)
