"""POST /v1/chat/completions: messages rendered with the model's chat template; n choices; streaming.

With `--reasoning-parser deepseek-r1` (and the request's `separate_reasoning`,
default true) the `<think>` section goes to `reasoning_content`, in whole
responses and in streamed deltas alike. The request/response skeleton (parse,
submit, wait or stream, framing) is endpoint.py's, shared with /v1/completions;
this module plans the generation and shapes the choices.

Tools (tool_calls.py): `tools` reach the chat template; with `tool_choice` auto
the output is parsed for DeepSeek tool calls (tool_parser.py), whole or as
streamed deltas (id and name, then argument fragments), and `finish_reason`
becomes "tool_calls"; `required` or a named function also constrain the output
by a grammar. Structured outputs (structured.py): `response_format`, `regex`,
`ebnf` become a grammar. The grammar spec travels with each sequence to the
engine, which masks the logits (engine/grammar); with a reasoning parser whose
model reasons first, it starts after the reasoning block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from engine.grammar.spec import GrammarSpec
from engine.server.endpoint import ChunkFn, Endpoint, respond
from engine.server.errors import APIError
from engine.server.formatting import TokenText, chat_logprobs
from engine.server.generation import Generation, Sequence
from engine.server.inputs import base_params, chat_prompt, check_prompt, choice_params, max_new_tokens
from engine.server.reasoning import ReasoningParser
from engine.server.schemas import ChatRequest
from engine.server.state import ServerState
from engine.server.structured import response_grammar
from engine.server.tool_calls import tool_format, tool_grammar, uses_tools
from engine.server.tool_parser import ToolCallParser


@dataclass
class _Plan:
    gen: Generation
    reasoning: Optional[str]  # parser name, or None
    logprobs: bool
    thinking: bool = False  # chat_template_kwargs' thinking (V3.1's switch)
    tools: Optional[str] = None  # the tool-call format to read calls in (None: no tools)


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
    thinking = bool((req.chat_template_kwargs or {}).get("thinking"))
    fmt, grammar = _grammar(state, req, thinking)
    seqs = [Sequence(ids, choice_params(base, mt, req.seed, j), state.tokenizer, grammar=grammar) for j in range(n)]
    parser = state.args.reasoning_parser if req.separate_reasoning is not False else None
    return _Plan(Generation(state.client, seqs, state.metrics), parser, bool(req.logprobs), thinking, fmt)


def _grammar(state: ServerState, req: ChatRequest, thinking: bool) -> tuple[Optional[str], Optional[GrammarSpec]]:
    """(tool-call format or None, the output's grammar or None). With a reasoning parser whose model opens a
    reasoning block, the grammar starts after it."""
    name = state.args.reasoning_parser
    after = name is not None and ReasoningParser(name, thinking).in_reasoning
    fmt = tool_format(state.tokenizer, state.args.tool_call_parser) if uses_tools(req) else None
    tools = tool_grammar(req, fmt, after)
    response = response_grammar(req, after)
    if tools is not None and response is not None:
        raise APIError(400, "tool_choice required or a named function cannot be combined with a constrained "
                       "response format", param="tool_choice")
    return fmt, tools or response


def _message(plan: _Plan, seq: Sequence) -> dict:
    msg = {"role": "assistant", "content": seq.text}
    if plan.reasoning:
        reasoning, content = ReasoningParser(plan.reasoning, plan.thinking).parse(seq.text)
        msg["content"], msg["reasoning_content"] = content or None, reasoning or None
    if plan.tools is not None:
        content, calls = ToolCallParser(plan.tools).parse(msg["content"] or "")
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return msg


def _finish(seq: Sequence, called: bool) -> Optional[str]:
    """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if called and seq.finish_reason == "stop" else seq.finish_reason


def _choices(state: ServerState, plan: _Plan) -> list[dict]:
    tok = TokenText(state.tokenizer)
    messages = [_message(plan, s) for s in plan.gen.sequences]
    return [{"index": i, "message": m,
             "logprobs": chat_logprobs(s, tok, 0, len(s.output_ids)) if plan.logprobs else None,
             "finish_reason": _finish(s, "tool_calls" in m), "matched_stop": s.matched_stop}
            for i, (s, m) in enumerate(zip(plan.gen.sequences, messages))]


async def _chunks(state: ServerState, plan: _Plan, chunk: ChunkFn):
    tok = TokenText(state.tokenizer)
    seqs = plan.gen.sequences
    sent = [0] * len(seqs)
    parsers = [ReasoningParser(plan.reasoning, plan.thinking) if plan.reasoning else None for _ in seqs]
    calls = [ToolCallParser(plan.tools) if plan.tools else None for _ in seqs]

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
        if calls[i] is not None:
            content, tool_deltas = calls[i].feed(delta.pop("content", ""), final=out.finished)
            if content:
                delta["content"] = content
            if tool_deltas:
                delta["tool_calls"] = [d.openai() for d in tool_deltas]
        lp = None
        if plan.logprobs and len(seq.output_ids) > sent[i]:
            lp = chat_logprobs(seq, tok, sent[i], len(seq.output_ids))
            sent[i] = len(seq.output_ids)
        if delta or lp or out.finished:
            finish = _finish(seq, bool(calls[i] and calls[i].calls)) if out.finished else None
            yield choice(i, delta, finish, lp)


CHAT = Endpoint(ChatRequest, "chatcmpl", "chat.completion", "chat.completion.chunk", _plan, _choices, _chunks)


async def chat_completions(request: Request) -> Response:
    return await respond(request, CHAT)
