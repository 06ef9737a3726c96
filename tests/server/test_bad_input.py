"""Bad requests get a 4xx with an OpenAI-style JSON error body, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

CTX = 4096  # tiny's max_position_embeddings
VOCAB = 320
OK_MSG = [{"role": "user", "content": "hi"}]

CASES = {
    # name: (path, body or raw bytes, status)
    "malformed json": ("/v1/completions", b'{"prompt": "hi", ', 400),
    "not utf-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    "body is a list": ("/v1/completions", [1, 2], 400),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, 400),
    "prompt wrong type": ("/v1/completions", {"prompt": 5}, 400),
    "prompt mixed list": ("/v1/completions", {"prompt": ["a", 3]}, 400),
    "empty prompt list": ("/v1/completions", {"prompt": []}, 400),
    "max_tokens as string": ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400),
    "max_tokens negative": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    "max_tokens beyond context": ("/v1/completions", {"prompt": "hi", "max_tokens": CTX}, 400),
    "temperature negative": ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    "temperature too high": ("/v1/completions", {"prompt": "hi", "temperature": 9}, 400),
    "temperature as bool": ("/v1/completions", {"prompt": "hi", "temperature": True}, 400),
    "top_p zero": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    "top_p above one": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    "top_k below -1": ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400),
    "min_p above one": ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400),
    "n zero": ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    "logprobs too many": ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400),
    "stop wrong type": ("/v1/completions", {"prompt": "hi", "stop": 3}, 400),
    "seed as float": ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400),
    "prompt longer than context": ("/v1/completions", {"prompt": [1] * CTX}, 400),
    "token id beyond vocab": ("/v1/completions", {"prompt": [1, 2, VOCAB + 5]}, 400),
    "negative token id": ("/v1/completions", {"prompt": [1, -3]}, 400),
    "stop token id beyond vocab": ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 6]}, 400),
    "presence_penalty above two": ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400),
    "repetition_penalty zero": ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    "logit_bias id beyond vocab": ("/v1/completions", {"prompt": "hi", "logit_bias": {str(VOCAB): 1.0}}, 400),
    "logit_bias not an id": ("/v1/chat/completions", {"messages": OK_MSG, "logit_bias": {"a": 1.0}}, 400),
    "logit_bias above 100": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    "min_tokens above max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, 400),
    "best_of below n": ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400),
    "best_of with stream": ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400),
    "best_of greedy": ("/v1/completions", {"prompt": "hi", "best_of": 2, "temperature": 0}, 400),
    "chat_template_kwargs reserved": (
        "/v1/chat/completions", {"messages": OK_MSG, "chat_template_kwargs": {"tokenize": True}}, 400),
    "unknown model": ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400),
    "messages wrong type": ("/v1/chat/completions", {"messages": "hi"}, 400),
    "content wrong type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    "chat max_tokens zero": ("/v1/chat/completions", {"messages": OK_MSG, "max_tokens": 0}, 400),
    "chat max_tokens beyond context": ("/v1/chat/completions", {"messages": OK_MSG, "max_tokens": CTX}, 400),
    "chat prompt longer than context": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * CTX}]}, 400),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": OK_MSG, "top_logprobs": 2}, 400),
    "chat tools": ("/v1/chat/completions", {"messages": OK_MSG, "tools": [{"type": "function"}]}, 400),
    "stream as string": ("/v1/chat/completions", {"messages": OK_MSG, "stream": "yes"}, 400),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_gets_a_json_error(server, name):
    path, body, status = CASES[name]
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_route_and_wrong_method_are_json_errors(server):
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = server.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_context_errors_name_the_parameter(server):
    err = server.post("/v1/completions", {"prompt": [1] * CTX}).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    err = server.post("/v1/completions", {"prompt": "hi", "max_tokens": CTX}).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"


def test_openai_client_sees_bad_request_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=OK_MSG)


def test_server_still_serves_after_bad_requests(server):
    """Runs after the cases above (file order) on the same server."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = server.client().completions.create(model=MODEL_NAME, prompt="still alive", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    m = server.metrics()
    assert m["dsctl_num_requests_running"] == 0 and m["dsctl_engine_healthy"] == 1
