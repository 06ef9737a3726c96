"""A minimal OpenAI-compatible streaming server with known timing and injected failures.

Each completion streams `max_tokens` chunks of "tok ": the first after `ttft`
seconds, the next ones `itl` apart, except the gap before chunk `slow_index`,
which lasts `slow_gap` seconds. Prompts containing FAIL get an HTTP 500, CUT
drops the connection after two chunks, ERREVENT streams an error event. A prompt
of token ids counts one token per id (or gets a 400 when `accept_token_ids` is
off); a text prompt counts one token per whitespace-separated word. Requests
without "stream": true get one JSON answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class Behaviour:
    ttft: float = 0.2
    itl: float = 0.03
    slow_index: Optional[int] = None
    slow_gap: float = 0.0
    send_usage: bool = True
    accept_token_ids: bool = True
    extra_prompt_tokens: int = 0  # added to every prompt's count, as a server with a different tokenizer would


class FakeOpenAI:
    def __init__(self, behaviour: Optional[Behaviour] = None):
        self.behaviour = behaviour or Behaviour()
        self.in_flight = self.max_in_flight = self.requests = 0
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.complete, methods=["POST"]),
            Route("/v1/chat/completions", self.complete, methods=["POST"]),
        ])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def start(self) -> "FakeOpenAI":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def _enter(self, body: dict) -> None:
        with self._lock:
            self.requests += 1
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    async def complete(self, request: Request):
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self._enter(body)
        if isinstance(prompt, list) and not self.behaviour.accept_token_ids:
            self._leave()
            return JSONResponse({"error": {"message": "prompt: Input should be a valid string", "code": 400}},
                                status_code=400)
        if isinstance(prompt, str) and "FAIL" in prompt:
            self._leave()
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
        n = int(body["max_tokens"])
        if not body.get("stream"):
            self._leave()
            return JSONResponse({"choices": [{"index": 0, "text": "tok " * n}], "usage": self._usage(prompt, n)})
        return StreamingResponse(self._stream(prompt, n, chat,
                                              body.get("stream_options", {}).get("include_usage", False)),
                                 media_type="text/event-stream")

    async def _stream(self, prompt, n: int, chat: bool, include_usage: bool):
        b = self.behaviour
        try:
            for i in range(n):
                await asyncio.sleep(b.ttft if i == 0 else (b.slow_gap if i == b.slow_index else b.itl))
                if isinstance(prompt, str) and "CUT" in prompt and i == 2:
                    raise ConnectionError("injected disconnect")
                if isinstance(prompt, str) and "ERREVENT" in prompt and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "injected error event"}}) + "\n\n"
                    return
                choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            if include_usage and b.send_usage:
                yield "data: " + json.dumps({"choices": [], "usage": self._usage(prompt, n)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._leave()

    def _usage(self, prompt, n: int) -> dict:
        plen = (len(prompt) if isinstance(prompt, list) else len(prompt.split())) + self.behaviour.extra_prompt_tokens
        return {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
