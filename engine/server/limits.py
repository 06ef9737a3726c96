"""Request limits checked before a request reaches the engine: body size, JSON shape, fan-out, prompt tokens.

`read_body` reads the body chunk by chunk and answers 413 as soon as it passes
--max-body-bytes (a Content-Length above it is refused before anything is
read). `decode_json` turns the bytes into JSON with a 400 for anything that is
not: malformed or too deeply nested JSON (--max-json-depth), and strings that
are not valid Unicode (a lone UTF-16 surrogate such as "\\ud800"), naming the
field. `check_sequences` bounds prompts x n, or x best_of (--max-sequences-per-request), and
`check_prompt_tokens` the prompt tokens of one request
(--max-request-prompt-tokens). A limit of 0 is no limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from engine.args import ServerArgs
from engine.server.errors import APIError, bad_request

# A JSON \\u escape of a UTF-16 surrogate: the only way a lone surrogate gets into decoded JSON (raw surrogate
# bytes are not UTF-8, which json.loads refuses). Bodies without one skip the walk over every string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 0
    max_json_depth: int = 0
    max_sequences: int = 0
    max_prompt_tokens: int = 0

    @classmethod
    def of(cls, args: ServerArgs) -> "Limits":
        return cls(args.max_body_bytes, args.max_json_depth, args.max_sequences_per_request,
                   args.max_request_prompt_tokens)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


class ClientGone(Exception):
    """The client disconnected before its body was read."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 as soon as it is known to exceed `limit` bytes (0: no limit)."""
    if limit:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if limit and size > limit:
                raise too_large(limit)
            parts.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(parts)


def decode_json(raw: bytes, max_depth: int):
    """JSON from the body, or a 400: malformed, nested deeper than max_depth, or holding invalid Unicode."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    check_strings = _SURROGATE_ESCAPE.search(raw) is not None
    if max_depth or check_strings:
        _walk(data, max_depth, check_strings)
    return data


def _too_deep(max_depth: int) -> APIError:
    limit = f"more than {max_depth} levels" if max_depth else "too deeply"
    return bad_request(f"the request body's JSON is nested {limit} (--max-json-depth)", code="invalid_json")


def _walk(data, max_depth: int, check_strings: bool) -> None:
    """Depth of every container and (check_strings) every string and key, without recursion."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            if max_depth and depth > max_depth:
                raise _too_deep(max_depth)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                name = f"{path}.{key}" if path else str(key)
                if check_strings and isinstance(key, str) and _SURROGATE.search(key):
                    raise _bad_unicode(path or "body")
                if isinstance(item, (dict, list)) or (check_strings and isinstance(item, str)):
                    stack.append((item, depth + 1, name))
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise _bad_unicode(path)


def _bad_unicode(path: str) -> APIError:
    return bad_request(f"{path}: not valid Unicode (a lone UTF-16 surrogate escape such as \\ud800)",
                       param=path, code="invalid_unicode")


def sequence_count(body) -> tuple[int, str]:
    """(sequences the request asks for: prompts x n, or prompts x best_of where completions' best_of
    generates more; the field to name when that is too many)."""
    n, field = body.n or 1, "n"
    best_of = getattr(body, "best_of", None) or 1
    if best_of > n:
        n, field = best_of, "best_of"
    prompt = getattr(body, "prompt", None)
    if prompt is None or isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return n, field
    return len(prompt) * n, "prompt"


def check_sequences(body, limit: int) -> None:
    count, param = sequence_count(body)
    if limit and count > limit:
        raise bad_request(f"this request asks for {count} sequences (prompts x n); at most {limit} are allowed "
                          "(--max-sequences-per-request)", param=param, code="too_many_sequences")


def check_prompt_tokens(total: int, limit: int, param: str) -> None:
    if limit and total > limit:
        raise bad_request(f"this request's prompts hold {total} tokens; at most {limit} are allowed per request "
                          "(--max-request-prompt-tokens)", param=param, code="too_many_prompt_tokens")
