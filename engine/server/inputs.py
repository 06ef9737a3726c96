"""From a validated request body to token ids and SamplingParams, checked against the model's limits.

Everything the engine would refuse is refused here first, with a 400 that names
the parameter: empty prompts, prompts that do not fit the context, token ids
outside the vocabulary (the engine's own prompt check, with its messages),
max_tokens beyond the context, sampling values the engine rejects.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from engine.errors import RequestError
from engine.runtime.protocol import EngineInfo
from engine.sampling import SamplingParams
from engine.scheduler import prompt_check
from engine.server.errors import bad_request
from engine.server.schemas import MAX_STOP, ChatRequest, CompletionRequest, SamplingFields
from engine.server.tool_calls import template_messages, template_tools

# Template variables the server sets itself (or that apply_chat_template takes as its own arguments).
RESERVED_TEMPLATE_VARIABLES = {"messages", "conversation", "tokenize", "add_generation_prompt", "return_dict",
                               "tools", "documents", "chat_template", "continue_final_message"}


def _need_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise bad_request(f"this model has no tokenizer files, so {what} cannot be used; send token ids",
                          param="prompt")
    return tokenizer


def completion_prompts(req: CompletionRequest, tokenizer) -> list[tuple[Optional[str], list[int]]]:
    """[(prompt text or None, token ids)] for each prompt of a completion request."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif len(p) == 0:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    for i, item in enumerate(items):
        if len(item) == 0:
            raise bad_request("prompt must not be empty", param="prompt" if len(items) == 1 else f"prompt.{i}")
        if isinstance(item, str):
            out.append((item, _need_tokenizer(tokenizer, "text prompts").encode(item)))
        else:
            out.append((None, list(item)))
    return out


def chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
    tok = _need_tokenizer(tokenizer, "chat messages")
    messages = template_messages(req.messages)
    variables = req.chat_template_kwargs or {}
    reserved = sorted(set(variables) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    try:
        return tok.apply_chat_template(messages, **variables, **template_tools(req))
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. bad role order) are the client's
        raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from None


def check_prompt(ids: Sequence[int], info: EngineInfo, param: str = "prompt") -> None:
    """The engine's prompt check (engine/scheduler/prompt_check.py) as a 400 naming `param`."""
    limits = prompt_check.PromptLimits(info.max_model_len, info.vocab_size, info.request_kv_tokens)
    try:
        prompt_check.check_prompt(ids, limits)
    except prompt_check.PromptError as exc:
        raise bad_request(str(exc), param=param, code=exc.code) from None


def max_new_tokens(requested: Optional[int], prompt_len: int, info: EngineInfo, param: str) -> int:
    room = info.max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(f"this model's maximum context length is {info.max_model_len} tokens; you asked for "
                          f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} to generate)",
                          param=param, code="context_length_exceeded")
    return requested


def _stops(req: SamplingFields) -> list[str]:
    stop = req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings are allowed", param="stop")
    return stops


def base_params(req: SamplingFields, info: EngineInfo) -> SamplingParams:
    """SamplingParams common to every choice of a request (max_new_tokens and seed set per choice)."""
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < info.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids {bad[:5]} outside the vocabulary [0, {info.vocab_size})",
                          param="stop_token_ids")
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        stop=_stops(req),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req.logit_bias, info.vocab_size),
        skip_special_tokens=req.skip_special_tokens is not False,
    )
    return _validated(params)


def logit_bias(bias: Optional[dict[str, float]], vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) with int keys; a 400 naming a bad entry."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (got {key!r})", param="logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias for token {tok} must be in [-100, 100] (got {value})", param="logit_bias")
        out[tok] = value
    return out


def _validated(params: SamplingParams) -> SamplingParams:
    try:
        return params.validate()
    except RequestError as exc:
        raise bad_request(str(exc)) from None


def choice_params(base: SamplingParams, max_tokens: int, seed: Optional[int], index: int) -> SamplingParams:
    """The params of choice `index`: seeded choices get seed + index so n > 1 choices differ."""
    s = None if seed is None else (seed + index) % 2 ** 64
    if base.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({base.min_tokens}) must not exceed the tokens to generate ({max_tokens})",
                          param="min_tokens")
    return _validated(dataclasses.replace(base, max_new_tokens=max_tokens, seed=s, stop=list(base.stop),
                                          stop_token_ids=list(base.stop_token_ids)))
