"""Request bodies of the OpenAI-compatible routes, checked with pydantic (strict types, ranges).

Unknown fields are ignored (clients send many optional ones); fields the engine
does not implement are accepted only at their neutral values. `parse_body`
turns malformed JSON and every validation failure into a 400 APIError.
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Type, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.server.errors import APIError, bad_request

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


TokenIds = list[int]


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions (None = default)."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        """The name of a field set to a value the engine cannot honour."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: Optional[int] = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    separate_reasoning: Optional[bool] = True
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None

    def unsupported(self) -> Optional[str]:
        if self.tools:
            return "tools"
        return super().unsupported()


M = TypeVar("M", bound=BaseModel)


def _describe(err: dict) -> tuple[str, str]:
    loc = ".".join(str(x) for x in err.get("loc", ()) if not _is_union_tag(x))
    return loc, f"{loc or 'body'}: {err.get('msg', 'invalid value')}"


def _is_union_tag(x) -> bool:
    """pydantic names union branches in error locations (`str`, `list[int]`); drop them."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)


def parse_body(raw: bytes, model: Type[M]) -> M:
    """Decode JSON and validate it against model; raise a 400 APIError on any problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param, first = _describe(errors[0])
        extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise bad_request(first + extra, param=param or None, code="invalid_value") from None
    field = req.unsupported()
    if field is not None:
        raise APIError(400, f"'{field}' is not supported by this server", param=field, code="unsupported")
    return req
