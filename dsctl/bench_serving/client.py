"""Streaming client for OpenAI-compatible /v1/completions and /v1/chat/completions.

Times each request from the moment it is sent: TTFT is the first chunk that
carries text (content or reasoning), ITLs are the gaps between text chunks.
Token counts come from the stream's usage chunk (stream_options.include_usage)
when the server sends one, else from the tokenizer after the run (count_tokens),
else from the number of text chunks; each result also keeps the lengths that were
asked for, so the report can show where the server counted differently.
Any failure (HTTP error, error event, broken stream, timeout) becomes a failed
result with its message; nothing is dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from dsctl.bench_serving.datasets import BenchRequest
from dsctl.bench_serving.tokens import TokenCounter


@dataclass(frozen=True)
class Api:
    base_url: str  # without /v1
    model: str
    kind: str = "completions"  # or "chat"
    api_key: Optional[str] = None
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int
    start: float  # seconds since the benchmark started
    latency: float  # send -> end of stream
    ttft: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since send, chunks with text
    error: str = ""
    counted_by: str = "estimate"  # usage | tokenizer | estimate
    asked_prompt_len: Optional[int] = None  # the request's prompt_len / max_tokens, for comparison
    asked_output_len: Optional[int] = None
    text: Optional[str] = None  # the streamed text, kept only while it waits for count_tokens (no usage)

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        if not self.ok or self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


class StreamError(Exception):
    pass


def _chunk_text(obj: dict, kind: str) -> str:
    choices = obj.get("choices")
    if not choices:
        return ""
    if kind == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


def _error_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        err = json.loads(text).get("error", text)
        text = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {text[:200]}"


class StreamEvents:
    """The server-sent events of one response, fed the bytes as they arrive.

    The hot path of the benchmark: per read, one split into lines; per event, one json.loads.
    Every event of one read gets the read's timestamp (when the client could first see it).
    """

    __slots__ = ("kind", "start", "times", "pieces", "usage", "done", "_rest")

    def __init__(self, kind: str, start: float):
        self.kind, self.start = kind, start
        self.times: list[float] = []  # seconds since send, events with text
        self.pieces: list[str] = []
        self.usage: dict = {}
        self.done = False
        self._rest = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._rest + data).split(b"\n") if self._rest else data.split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and not self.done:
                self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        obj = json.loads(payload)
        if obj.get("error"):
            err = obj["error"]
            raise StreamError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
        text = _chunk_text(obj, self.kind)
        if text:
            self.times.append(now - self.start)
            self.pieces.append(text)
        if obj.get("usage"):
            self.usage = obj["usage"]


async def send(client, api: Api, req: BenchRequest, t0: float) -> RequestResult:
    """Send one streaming request; never raises for request-level failures.

    Without a usage event, the output is counted by its text chunks and the text is kept for
    count_tokens, which counts it with the tokenizer after the run (off the timed path).
    """
    start = time.perf_counter()
    events = StreamEvents(api.kind, start)
    try:
        async with client.stream("POST", api.url, json=api.body(req), headers=api.headers) as response:
            if response.status_code != 200:
                raise StreamError(_error_text(response.status_code, await response.aread()))
            async for data in response.aiter_bytes():
                events.feed(data, time.perf_counter())
                if events.done:
                    break
            if not events.done:
                raise StreamError("stream ended without [DONE]")
    except Exception as exc:  # httpx errors, bad JSON, StreamError
        message = str(exc) if isinstance(exc, StreamError) else f"{type(exc).__name__}: {exc}"
        return RequestResult(False, req.prompt_len, 0, start - t0, time.perf_counter() - start,
                             error=message or type(exc).__name__, asked_prompt_len=req.prompt_len,
                             asked_output_len=req.output_len)
    latency = time.perf_counter() - start
    times, usage = events.times, events.usage
    result = RequestResult(True, req.prompt_len, len(times), start - t0, latency, times[0] if times else None,
                           times, asked_prompt_len=req.prompt_len, asked_output_len=req.output_len)
    if usage.get("completion_tokens") is not None:
        result.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
        result.output_len, result.counted_by = int(usage["completion_tokens"]), "usage"
    else:
        result.text = "".join(events.pieces)
    return result


def count_tokens(results: list[RequestResult], tok: Optional[TokenCounter]) -> None:
    """Count with the tokenizer the output of the results the server sent no usage for (in place)."""
    waiting = [r for r in results if r.text is not None]
    if tok is not None and waiting:
        for r, ids in zip(waiting, tok.encode_each([r.text for r in waiting])):
            r.output_len, r.counted_by = len(ids), "tokenizer"
    for r in waiting:
        r.text = None


def accepts_token_ids(api: Api, ids: list[int], timeout: float = 600.0) -> tuple[bool, str]:
    """Whether /v1/completions takes a token-id prompt: (True, "") or (False, the server's refusal).

    One untimed request for one token. Only a 400/422 answer counts as a refusal; other failures
    (a server that is down, say) are left for the benchmark itself to report.
    """
    body = {"model": api.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": False}
    try:
        response = httpx.post(api.url, json=body, headers=api.headers, timeout=timeout)
    except httpx.HTTPError:
        return True, ""
    if response.status_code in (400, 422):  # a bad-request answer; 401/404 are not about the prompt's form
        return False, _error_text(response.status_code, response.content)
    return True, ""
