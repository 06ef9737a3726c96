"""POST /v1/completions: text or token-id prompts (one or many), n choices, best_of, echo, logprobs, streaming.

Choices are ordered prompt-major (prompt i's choices are i*n .. i*n+n-1), as in
OpenAI's API. `echo` with `logprobs` lists the prompt tokens first with their
log-probs (the first token has none), which is how evaluation harnesses score
a continuation; with max_tokens 0 the engine still runs one step for the
prompt log-probs and the generated token is dropped. With best_of > n each
prompt gets best_of sampled sequences and the n with the highest cumulative
log-probability are returned (not with stream, not with greedy sampling, where
every candidate would be the same). The request/response
skeleton (parse, submit, wait or stream, framing) is endpoint.py's, shared with
/v1/chat/completions; this module plans the generation and shapes the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from engine.server.endpoint import ChunkFn, Endpoint, respond
from engine.server.errors import bad_request
from engine.server.formatting import TokenText, completion_logprobs
from engine.server.generation import Generation, Sequence
from engine.server.inputs import base_params, check_prompt, choice_params, completion_prompts, max_new_tokens
from engine.server.schemas import CompletionRequest
from engine.server.state import ServerState


@dataclass
class _Plan:
    gen: Generation
    echo: bool
    top: "int | None"  # the logprobs value (None: no log-probs)
    drop_output: bool  # max_tokens 0 with echo + logprobs
    n: int = 1  # choices per prompt
    best_of: int = 1  # sequences generated per prompt (>= n)


def _plan(state: ServerState, req: CompletionRequest) -> _Plan:
    state.check_model(req.model)
    info = state.info()
    prompts = completion_prompts(req, state.tokenizer)
    base = base_params(req, info)
    n, echo, top = req.n or 1, bool(req.echo), req.logprobs
    best_of = _best_of(req, n, base)
    want = 16 if req.max_tokens is None else req.max_tokens
    drop = want == 0 and echo and top is not None
    base.logprobs, base.top_logprobs = top is not None or best_of > n, top or 0  # best_of ranks by log-probs
    base.prompt_logprobs = echo and top is not None
    seqs = []
    for pi, (text, ids) in enumerate(prompts):
        check_prompt(ids, info)
        mt = max_new_tokens(want, len(ids), info, "max_tokens")
        if drop:
            mt = 1
        if echo and text is None:
            text = state.tokenizer.decode(ids, base.skip_special_tokens) if state.tokenizer else ""
        for j in range(best_of):
            params = choice_params(base, mt, req.seed, pi * best_of + j)
            seqs.append(Sequence(ids, params, state.tokenizer, prompt_text=text, prompt_index=pi,
                                 discard_output=drop))
    return _Plan(Generation(state.client, seqs, state.metrics), echo, top, drop, n, best_of)


def _best_of(req: CompletionRequest, n: int, base) -> int:
    """Sequences to generate per prompt; a 400 where best_of is not meaningful."""
    best_of = req.best_of or n
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if best_of > n and req.stream:
        raise bad_request("best_of > n cannot be used with stream (the best sequences are known only at the end)",
                          param="best_of")
    if best_of > n and base.greedy:
        raise bad_request("best_of > n needs sampling (temperature > 0 and top_k != 1): greedy candidates are all "
                          "the same", param="best_of")
    return best_of


def _picked(plan: _Plan) -> list[Sequence]:
    """The sequences returned, prompt-major: per prompt the n of its best_of with the highest cumulative log-prob."""
    seqs = plan.gen.sequences
    if plan.best_of == plan.n:
        return seqs
    out = []
    for start in range(0, len(seqs), plan.best_of):
        group = seqs[start:start + plan.best_of]
        out += sorted(group, key=lambda s: -sum(s.logprobs))[:plan.n]
    return out


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


def _choices(state: ServerState, plan: _Plan) -> list[dict]:
    tok = TokenText(state.tokenizer)
    return [_choice(plan, i, s, tok) for i, s in enumerate(_picked(plan))]


async def _chunks(state: ServerState, plan: _Plan, chunk: ChunkFn):
    tok = TokenText(state.tokenizer)
    seqs = plan.gen.sequences
    sent = [0] * len(seqs)  # output tokens already listed in logprobs
    echoed = [not plan.echo] * len(seqs)
    if plan.echo and plan.top is None:  # with log-probs the prompt goes out with its log-probs
        for i, seq in enumerate(seqs):
            echoed[i] = True
            yield chunk([{"index": i, "text": seq.prompt_text or "", "logprobs": None, "finish_reason": None}])
    async for i, delta, out in plan.gen.events():
        seq = seqs[i]
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


COMPLETIONS = Endpoint(CompletionRequest, "cmpl", "text_completion", "text_completion", _plan, _choices, _chunks)


async def completions(request: Request) -> Response:
    return await respond(request, COMPLETIONS)
