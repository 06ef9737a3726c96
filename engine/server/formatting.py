"""Response pieces shared by the completion routes: ids, SSE framing, log-prob listings."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Optional

from engine.server.generation import Sequence


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


_JSON = json.JSONEncoder(ensure_ascii=False)  # one encoder for every body: json.dumps builds one per call
_CHOICES = "\x00choices\x00"  # a placeholder no JSON body holds, split out of a chunk's encoding


def sse(obj) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


def sse_chunks(body: dict) -> Callable[[list], str]:
    """fn(choices) -> the SSE event of `body` (whose "choices" is a placeholder) with those choices: the body's
    other fields are encoded once per response, not once per streamed chunk. Same text as `sse`."""
    head, tail = _JSON.encode({**body, "choices": _CHOICES}).split(_JSON.encode(_CHOICES))
    head, tail = f"data: {head}", f"{tail}\n\n"
    encode = _JSON.encode
    return lambda choices: f"{head}{encode(choices)}{tail}"


SSE_DONE = "data: [DONE]\n\n"


def decode_token(tokenizer, token_id: int) -> str:
    """The text of one token on its own (for log-prob listings)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode([token_id], False)


def token_bytes(text: Optional[str]) -> list[int]:
    return list(text.encode("utf-8")) if text else []


class TokenText:
    """Per-request cache of token id -> text (log-prob listings repeat the same tokens a lot)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = decode_token(self.tokenizer, token_id)
        return text


def completion_logprobs(seq: Sequence, tok: TokenText, echo: bool, start: int, end: int,
                        offset: int) -> dict:
    """Legacy completions `logprobs` for output tokens [start, end) (and the prompt when echo).

    top_logprobs entries hold the top-k alternatives plus the chosen token, as
    evaluation harnesses expect; offset is the text offset of the first token listed.
    """
    tokens, lps, tops, offsets = [], [], [], []

    def add(token_id: int, lp: Optional[float], top: Optional[dict]):
        nonlocal offset
        text = tok(token_id)
        tokens.append(text)
        lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)

    if echo:
        plp = seq.prompt_logprobs or [None] * len(seq.prompt_ids)
        ptop = seq.prompt_top_logprobs
        for i, token_id in enumerate(seq.prompt_ids):
            lp = plp[i] if i < len(plp) else None
            top = _top_dict(tok, token_id, lp, ptop[i] if ptop and ptop[i] else []) if lp is not None else None
            add(token_id, lp, top)
    for i in range(start, end):
        token_id, lp = seq.output_ids[i], seq.logprobs[i] if i < len(seq.logprobs) else None
        alts = seq.top_logprobs[i] if i < len(seq.top_logprobs) else []
        add(token_id, lp, _top_dict(tok, token_id, lp, alts))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(tok: TokenText, token_id: int, lp: Optional[float], alts) -> dict:
    """text -> log-prob of the chosen token and its alternatives (most likely first).

    Several tokens can share a text (e.g. partial UTF-8 bytes all shown as U+FFFD);
    the chosen token keeps its own value and otherwise the most likely one wins.
    """
    top = {} if lp is None else {tok(token_id): lp}
    for t, v in alts:
        top.setdefault(tok(t), v)
    return top


def chat_logprobs(seq: Sequence, tok: TokenText, start: int, end: int) -> dict:
    """Chat `logprobs.content` entries for output tokens [start, end)."""
    content = []
    for i in range(start, end):
        token_id = seq.output_ids[i]
        text = tok(token_id)
        alts = seq.top_logprobs[i] if i < len(seq.top_logprobs) else []
        content.append({
            "token": text, "logprob": seq.logprobs[i] if i < len(seq.logprobs) else None,
            "bytes": token_bytes(text),
            "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": token_bytes(tok(t))} for t, v in alts],
        })
    return {"content": content}
