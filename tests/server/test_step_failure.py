"""A failing engine step and KV exhaustion, seen through HTTP (tiny model, CPU, 127.0.0.1).

The server runs in this process (uvicorn in a thread, the app from `build_app`); its engine process is
started with `engine_main(make_engine=make_poisoned_engine)`, passed to the EngineClient as its `rank_main`:
every prefill of a prompt that starts with POISON raises. The clients of a failed step's requests get an
error (a 500, or an error event in the stream), the engine goes on: requests in flight finish, new ones are
served.
The KV pool is small, so a burst of requests makes decode run out of KV: the retractions show in /metrics
and every request still gets the offline engine's greedy output.
"""

from __future__ import annotations

import functools
import json
import threading

import httpx
import pytest

from engine.args import EngineArgs
from engine.checkpoint.resolve import resolve_model
from engine.checkpoint.tokenizer import load_tokenizer
from engine.runtime.client import EngineClient
from engine.runtime.rank_loop import engine_main
from engine.server.app import build_app
from tests.scheduler.failing_runner import POISON, make_poisoned_engine
from tests.server.conftest import free_port, kv_settled, wait_for
from tests.server.offline_ref import reference

KV_TOKENS = 256


@pytest.fixture(scope="module")
def server():
    import uvicorn

    port = free_port()
    args = EngineArgs().replace(model="tiny", device="cpu", max_total_tokens=KV_TOKENS, port=port)
    tokenizer = load_tokenizer(resolve_model(args.model).tokenizer_path)
    client = EngineClient(args, rank_main=functools.partial(engine_main, make_engine=make_poisoned_engine))
    app = build_app(args, tokenizer, client)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    url = f"http://127.0.0.1:{port}"
    # The engine process must not inherit the Triton interpreter that tests/conftest.py turns on.
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TRITON_INTERPRET", raising=False)
        thread = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
        thread.start()
        assert wait_for(lambda: _health(url) == 200, timeout=150), "the in-process server did not come up"
    yield url
    srv.should_exit = True
    thread.join(60)


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class _Url:
    """What conftest.kv_settled reads: metrics()."""

    def __init__(self, url: str):
        self.url = url

    def metrics(self) -> dict[str, float]:
        return _metrics(self.url)


ERRORS = 'dsctl_request_finished_total{finish_reason="error"}'
BODY = {"temperature": 0, "ignore_eos": True}


def test_a_failed_step_answers_its_clients_with_errors_and_the_server_goes_on(server):
    errors = _metrics(server).get(ERRORS, 0.0)
    done = {}

    def long_stream():
        body = {**BODY, "prompt": [5, 6, 7, 8, 9], "max_tokens": 120, "stream": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            done["status"], done["lines"] = r.status_code, lines

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_for(lambda: _metrics(server)["dsctl_num_requests_running"] == 1, timeout=60)
    # Non-streaming: a 500 with the step's error.
    r = httpx.post(server + "/v1/completions", json={**BODY, "prompt": [POISON, 1, 2], "max_tokens": 5}, timeout=60)
    assert r.status_code == 500, r.text
    assert "injected failure" in r.json()["error"]["message"]
    # Streaming: an error event, then [DONE].
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={**BODY, "prompt": [POISON, 3], "max_tokens": 5, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "injected failure" in json.loads(events[-2])["error"]["message"]
    # The request in flight was not in the failed steps: it runs to its end.
    t.join(120)
    assert done["status"] == 200 and done["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in done["lines"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # New requests are served, and the failures were counted.
    r = httpx.post(server + "/v1/completions", json={**BODY, "prompt": [11, 12, 13], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert _health(server) == 200
    assert _metrics(server)[ERRORS] == errors + 2
    assert wait_for(lambda: kv_settled(_Url(server)), timeout=20), _metrics(server)


def test_kv_exhaustion_retracts_and_every_client_gets_the_offline_output(server):
    prompts = [[(17 * i + k) % 250 + 1 for k in range(12 + 3 * i)] for i in range(8)]
    assert sum(len(p) + 48 for p in prompts) > 2 * KV_TOKENS
    ref = reference([{"input_ids": prompts, "max_tokens": 48, "ignore_eos": True}])[0]
    before = _metrics(server)["dsctl_retracted_requests_total"]
    results = [None] * len(prompts)

    def one(i):
        results[i] = httpx.post(server + "/v1/completions", timeout=120,
                                json={**BODY, "prompt": prompts[i], "max_tokens": 48})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.status_code for r in results] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in results] == [o["text"] for o in ref]
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [48] * len(prompts)
    assert _metrics(server)["dsctl_retracted_requests_total"] > before
    assert wait_for(lambda: kv_settled(_Url(server)), timeout=20), _metrics(server)

