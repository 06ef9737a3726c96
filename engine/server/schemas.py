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


PROFILE_STEPS = 500  # engine steps a profile records unless the request asks otherwise (a forgotten one ends)
PROFILE_MAX_STEPS = 10_000


class ProfileRequest(_Strict):
    """POST /start_profile's optional body."""

    num_steps: int = Field(PROFILE_STEPS, ge=1, le=PROFILE_MAX_STEPS)

    def unsupported(self) -> Optional[str]:
        return None


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
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    logit_bias: Optional[dict[str, float]] = None  # token id (a string) -> bias in [-100, 100]
    min_tokens: Optional[int] = Field(None, ge=0)
    user: Optional[str] = None

    def unsupported(self) -> Optional[str]:
        """The name of a field set to a value the engine cannot honour."""
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
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None  # tool: the call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchema(_Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None  # type json_schema


FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema (absent: no arguments)
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    separate_reasoning: Optional[bool] = True
    chat_template_kwargs: Optional[dict] = None  # extra variables for the chat template (V3.1: thinking)
    response_format: Optional[ResponseFormat] = None
    regex: Optional[str] = None  # constrain the output to this regular expression (not an OpenAI field)
    ebnf: Optional[str] = None  # constrain the output to this EBNF grammar (not an OpenAI field)
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True


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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    return validate_body(data, model)


def validate_body(data, model: Type[M]) -> M:
    """Validate decoded JSON against model; raise a 400 APIError naming the field on any problem."""
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
