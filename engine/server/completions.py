"""POST /v1/completions: text or token-id prompts (one or many), n choices, echo, logprobs, streaming.

Choices are ordered prompt-major (prompt i's choices are i*n .. i*n+n-1), as in
OpenAI's API. `echo` with `logprobs` lists the prompt tokens first with their
log-probs (the first token has none), which is how evaluation harnesses score
a continuation; with max_tokens 0 the engine still runs one step for the
prompt log-probs and the generated token is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.server.errors import APIError, server_error
from engine.server.formatting import SSE_DONE, TokenText, completion_logprobs, new_id, now, sse
from engine.server.generation import Generation, Sequence
from engine.server.inputs import base_params, check_prompt, choice_params, completion_prompts, max_new_tokens
from engine.server.schemas import CompletionRequest, parse_body
from engine.server.state import ServerState, until_disconnect


@dataclass
class _Plan:
    req: CompletionRequest
    gen: Generation
    echo: bool
    top: "int | None"  # the logprobs value (None: no log-probs)
    drop_output: bool  # max_tokens 0 with echo + logprobs


def _plan(state: ServerState, req: CompletionRequest) -> _Plan:
    state.check_model(req.model)
    info = state.info()
    prompts = completion_prompts(req, state.tokenizer)
    base = base_params(req, info)
    n, echo, top = req.n or 1, bool(req.echo), req.logprobs
    want = 16 if req.max_tokens is None else req.max_tokens
    drop = want == 0 and echo and top is not None
    base.logprobs, base.top_logprobs = top is not None, top or 0
    base.prompt_logprobs = echo and top is not None
    seqs = []
    for pi, (text, ids) in enumerate(prompts):
        check_prompt(ids, info)
        mt = max_new_tokens(want, len(ids), info, "max_tokens")
        if drop:
            mt = 1
        if echo and text is None:
            text = state.tokenizer.decode(ids, base.skip_special_tokens) if state.tokenizer else ""
        for j in range(n):
            params = choice_params(base, mt, req.seed, pi * n + j)
            seqs.append(Sequence(ids, params, state.tokenizer, prompt_text=text, prompt_index=pi,
                                 discard_output=drop))
    return _Plan(req, Generation(state.client, seqs, state.metrics), echo, top, drop)


def _choice(plan: _Plan, i: int, seq: Sequence, tok: TokenText) -> dict:
    prefix = (seq.prompt_text or "") if plan.echo else ""
    lp = None
    if plan.top is not None:
        lp = completion_logprobs(seq, tok, plan.echo, 0, len(seq.output_ids), 0)
        if plan.echo and seq.prompt_text is not None:
            lp["text_offset"] = _echo_offsets(lp, len(seq.prompt_ids), len(seq.prompt_text))
    return {"index": i, "text": prefix + seq.text, "logprobs": lp, "finish_reason": seq.finish_reason,
            "matched_stop": seq.matched_stop}


def _echo_offsets(lp: dict, n_prompt: int, prompt_chars: int) -> list[int]:
    """Output token offsets start right after the echoed prompt text."""
    offsets = lp["text_offset"]
    if n_prompt < len(offsets):
        shift = prompt_chars - offsets[n_prompt]
        offsets = offsets[:n_prompt] + [o + shift for o in offsets[n_prompt:]]
    return offsets


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), CompletionRequest)
    plan = _plan(state, req)
    plan.gen.submit()
    rid, created = new_id("cmpl"), now()
    if req.stream:
        return StreamingResponse(_stream(state, plan, rid, created), media_type="text/event-stream")
    if not await until_disconnect(request, plan.gen.collect()):
        return Response(status_code=499)
    tok = TokenText(state.tokenizer)
    choices = [_choice(plan, i, s, tok) for i, s in enumerate(plan.gen.sequences)]
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": plan.gen.usage})


async def _stream(state: ServerState, plan: _Plan, rid: str, created: int):
    tok = TokenText(state.tokenizer)
    sent = [0] * len(plan.gen.sequences)  # output tokens already listed in logprobs
    include_usage = bool(plan.req.stream_options and plan.req.stream_options.include_usage)

    def chunk(choices: list[dict]) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = None
        return sse(body)

    echoed = [not plan.echo] * len(plan.gen.sequences)
    try:
        if plan.echo and plan.top is None:  # with log-probs the prompt goes out with its log-probs
            for i, seq in enumerate(plan.gen.sequences):
                echoed[i] = True
                yield chunk([{"index": i, "text": seq.prompt_text or "", "logprobs": None, "finish_reason": None}])
        async for i, delta, out in plan.gen.events():
            seq = plan.gen.sequences[i]
            echo_now = not echoed[i] and (out.prompt_logprobs is not None or out.finished)
            lp = None
            if plan.top is not None:
                lp = completion_logprobs(seq, tok, echo_now, sent[i], len(seq.output_ids), 0)
                sent[i] = len(seq.output_ids)
            if echo_now:
                echoed[i], delta = True, (seq.prompt_text or "") + delta
            if delta or out.finished or (lp and lp["tokens"]):
                yield chunk([{"index": i, "text": delta, "logprobs": lp,
                              "finish_reason": seq.finish_reason if out.finished else None}])
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                       "choices": [], "usage": plan.gen.usage})
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - end the stream with an error event, not a torn connection
        yield sse(server_error(f"internal error: {exc}").body())
    yield SSE_DONE
