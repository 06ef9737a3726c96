"""Random JSON at every field of /v1/completions and /v1/chat/completions: a 4xx or a 200, never a 5xx.

The app is the real one (`build_app`, the real tiny-py tokenizer and chat template) run in-process with
starlette's TestClient; its engine is `FakeEngine`, which answers every sequence at once with two
random tokens, so that a request that passes every check finishes in microseconds. After each example
/health must still answer 200. Also here: the limits' units (JSON depth, lone surrogates, body size)
and the clean error message API clients get when an engine rank dies.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from engine.args import EngineArgs
from engine.checkpoint.resolve import resolve_model
from engine.checkpoint.tokenizer import load_tokenizer
from engine.runtime.protocol import EngineInfo, EngineStats, RequestOutput
from engine.server.app import build_app
from engine.server.errors import APIError, engine_failed
from engine.server.limits import decode_json
from engine.server.schemas import ChatRequest, CompletionRequest

VOCAB = 320


class FakeEngine:
    """The part of EngineClient the server uses; every sequence finishes at once with two random tokens."""

    def __init__(self):
        self.info = None
        self.stats = EngineStats()
        self.dead_reason = None
        self.pending: set[str] = set()
        self.ready = None
        self.on_dead = None
        self.pid, self.pids = 4242, [4242]
        self.ids = itertools.count()
        self.rng = random.Random(0)
        self.loop = None

    @property
    def healthy(self) -> bool:
        return self.info is not None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.ready = asyncio.Event()
        self.info = EngineInfo(max_model_len=4096, vocab_size=VOCAB, kv_total_tokens=32768, max_running_requests=64,
                               pid=self.pid)
        self.ready.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def check_capacity(self, n: int) -> None:
        pass

    def submit(self, prompt_ids, params, sink, tag, **extra) -> str:
        rid = f"f{next(self.ids)}"
        tokens = [self.rng.randrange(VOCAB) for _ in range(2)]
        out = RequestOutput(rid, new_token_ids=tokens, finish_reason="length",
                            new_logprobs=[-1.0, -2.0] if params.logprobs else None,
                            new_top_logprobs=[[(t, -1.5)] for t in tokens] if params.logprobs else None,
                            prompt_logprobs=[None] + [-1.0] * (len(prompt_ids) - 1) if params.prompt_logprobs else None)
        self.loop.call_soon(sink.put_nowait, (tag, out))
        return rid

    def abort(self, rid: str) -> None:
        pass

    def abort_all(self) -> int:
        return 0

    def call_later(self, delay, fn) -> bool:
        return False


@pytest.fixture(scope="module")
def app_client():
    args = EngineArgs().replace(model="tiny-py", device="cpu", max_sequences_per_request=64,
                                max_request_prompt_tokens=2048)
    tokenizer = load_tokenizer(resolve_model(args.model).tokenizer_path)
    with TestClient(build_app(args, tokenizer, FakeEngine()), raise_server_exceptions=False) as client:
        yield client


# Any JSON value: scalars (huge ints, floats, every kind of string, lone surrogates included) and nestings.
_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | \
    st.text(st.sampled_from("\ud800\udfff\ud83d\x00\u2028a"), min_size=1, max_size=6)
_scalar = st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | \
    st.floats(allow_nan=False, allow_infinity=False) | _text | st.sampled_from(["", "stop", "text", "user", "tiny-py"])
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                     max_leaves=12)

BASES = {
    "/v1/completions": ({"prompt": "def f(x):", "max_tokens": 3}, CompletionRequest),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, ChatRequest),
}
# Every top-level field of both schemas, plus the nested ones a client fills in.
FIELDS = [(path, (name,)) for path, (_, schema) in BASES.items() for name in schema.model_fields] + [
    ("/v1/chat/completions", ("messages", 0, "role")), ("/v1/chat/completions", ("messages", 0, "content")),
    ("/v1/chat/completions", ("messages", 0, "name")), ("/v1/completions", ("stream_options", "include_usage")),
    ("/v1/completions", ("prompt", 0)), ("/v1/chat/completions", ("messages", 0)),
]


def _set(body: dict, where: tuple, value) -> dict:
    """body with body[where...] = value (creating lists / dicts on the way)."""
    body = json.loads(json.dumps(body))
    node = body
    for key, nxt in zip(where, where[1:]):
        if isinstance(node, list):
            node = node[0] if node else node
            continue
        if not isinstance(node.get(key), (dict, list)):
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    if isinstance(node, list):
        node[:1] = [value]
    else:
        node[where[-1]] = value
    return body


def _check(client: TestClient, path: str, content: bytes) -> None:
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, content[:300], r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert client.get("/health").status_code == 200


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=_text | _json, stream=st.booleans())
@example(field=("/v1/completions", ("model",)), value="\udfff", stream=False)  # the 500s
@example(field=("/v1/completions", ("prompt",)), value="a\ud800", stream=True)
@example(field=("/v1/chat/completions", ("messages", 0, "content")), value=[[[[[[[[]]]]]]]] * 3, stream=False)
def test_random_values_in_every_field_get_4xx_or_200(app_client, field, value, stream):
    path, where = field
    body = _set({**BASES[path][0], "stream": stream}, where, value)
    _check(app_client, path, json.dumps(body).encode())


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(list(BASES)), raw=st.binary(max_size=64) | _text.map(lambda s: s.encode("utf-8",
                                                                                                  "surrogatepass")))
def test_random_bodies_get_4xx(app_client, path, raw):
    r = app_client.post(path, content=raw)
    assert 400 <= r.status_code < 500, (raw, r.text)


def test_lone_surrogates_are_named_400s(app_client):
    cases = [("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
             ("/v1/completions", '{"prompt": "hi", "model": "\\udfff"}', "model"),
             ("/v1/completions", '{"prompt": ["ok", "\\udc00"]}', "prompt.1"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content")]
    for path, raw, param in cases:
        r = app_client.post(path, content=raw.encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = app_client.post("/v1/completions", content='{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'.encode())
    assert ok.status_code == 200, ok.text  # a surrogate pair is an ordinary character


def test_fan_out_and_prompt_token_limits(app_client):
    r = app_client.post("/v1/completions", json={"prompt": ["a"] * 9, "n": 8})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
    assert r.json()["error"]["param"] == "prompt"
    assert app_client.post("/v1/completions", json={"prompt": ["a"] * 8, "n": 8, "max_tokens": 1}).status_code == 200
    r = app_client.post("/v1/completions", json={"prompt": ["a"] * 9, "best_of": 8, "temperature": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text  # best_of fans out too
    r = app_client.post("/v1/completions", json={"prompt": "a", "best_of": 65, "temperature": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    many = [random.Random(1).randrange(1, VOCAB) for _ in range(1500)]
    r = app_client.post("/v1/completions", json={"prompt": [many, many], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompt_tokens", r.text
    assert app_client.post("/v1/completions", json={"prompt": [many], "max_tokens": 1}).status_code == 200


def test_empty_prompt_is_400(app_client):
    for prompt in ("", [[]], ["x", ""]):
        r = app_client.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), (prompt, r.text)


@pytest.mark.parametrize("depth", [65, 3000])
def test_deep_json_is_400(depth):
    with pytest.raises(APIError) as exc:
        decode_json(b"[" * depth + b"]" * depth, max_depth=64)
    assert exc.value.status == 400 and "nested" in exc.value.message
    assert decode_json(b'{"a":' * 63 + b"1" + b"}" * 63, max_depth=64)


def test_body_limit_is_checked_while_reading():
    """A chunked body (no Content-Length) is cut off at the limit: 413 before the rest is read."""
    args = EngineArgs().replace(model="tiny-py", device="cpu", max_body_bytes=1000)
    tokenizer = load_tokenizer(resolve_model(args.model).tokenizer_path)
    sent = []

    def chunks():
        for _ in range(100):
            sent.append(1)
            yield b" " * 100

    with TestClient(build_app(args, tokenizer, FakeEngine())) as client:
        r = client.post("/v1/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = client.post("/v1/completions", content=b" " * 2000)  # with a Content-Length
        assert r.status_code == 413
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_rank_death_message_is_clean():
    raw = ("engine rank 1 (pid 77) failed: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
           "Connection closed by peer [127.0.0.1]:41235")
    err = engine_failed(raw)
    assert err.status == 500 and "engine rank 1 failed" in err.message
    assert "gloo" not in err.message and "pair.cc" not in err.message
    assert "gloo" not in engine_failed("[gloo] Timed out waiting").message
