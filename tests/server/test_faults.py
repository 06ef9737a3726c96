"""Overload, client disconnects, SIGTERM and an engine crash on live `dsctl serve` processes.

`limited` runs one sequence at a time with room for one more in the queue, so a
long request holds the engine while the tests look at the queue and the KV pool.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import pytest

from tests.server.conftest import kv_settled, launch, wait_for

LONG = {"prompt": "a long one", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited():
    srv = launch("--max-queued-requests", "1", "--max-running-requests", "1", "--reasoning-parser", "deepseek-r1")
    yield srv
    srv.stop()


def _first_token(lines) -> None:
    """Read SSE lines until one carries generated text.

    Keep a reference to `lines` while the stream should stay open: a dropped
    `iter_lines()` generator closes the response, which is a client disconnect.
    """
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            body = json.loads(line[6:])
            if body.get("choices") and body["choices"][0].get("text"):
                return
    raise AssertionError("the stream ended before any text")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _aborted(srv) -> float:
    return srv.metrics().get('dsctl_request_finished_total{finish_reason="abort"}', 0.0)


def test_full_queue_gets_503_with_retry_after(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            running_lines = running.iter_lines()
            _first_token(running_lines)
            with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as queued:
                assert queued.status_code == 200
                assert wait_for(lambda: limited.metrics()["dsctl_num_requests_queued"] == 1, timeout=10)
                assert limited.metrics()["dsctl_num_requests_running"] == 1
                r = h.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
                assert r.status_code == 503
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["type"] == "service_unavailable_error"
    # Both streams were closed by the client: the engine drops them and frees their KV.
    assert wait_for(lambda: kv_settled(limited), timeout=20), limited.metrics()
    r = httpx.post(limited.url + "/v1/completions", json={"prompt": "room again", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_stream_disconnect_aborts_and_frees_kv(limited):
    aborted = _aborted(limited)
    with httpx.Client(base_url=limited.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            _first_token(lines)
            m = limited.metrics()
            assert m["dsctl_num_requests_running"] == 1, m
            assert m["dsctl_kv_cache_free_tokens"] < m["dsctl_kv_cache_total_tokens"]
    assert wait_for(lambda: kv_settled(limited), timeout=20), limited.metrics()  # long before 3000 tokens
    assert _aborted(limited) == aborted + 1


def test_non_streaming_disconnect_aborts_and_frees_kv(limited):
    aborted = _aborted(limited)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(limited.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=2))
    assert wait_for(lambda: kv_settled(limited) and _aborted(limited) == aborted + 1, timeout=20), \
        limited.metrics()


def test_reasoning_parser_moves_thinking_to_reasoning_content(limited):
    """tiny never writes </think>, so with deepseek-r1 parsing its whole answer is reasoning."""
    body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    msg = httpx.post(limited.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    plain = httpx.post(limited.url + "/v1/chat/completions", json={**body, "separate_reasoning": False},
                       timeout=60).json()["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] == plain["content"] and plain["content"]
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", limited.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert not any(d.get("content") for d in deltas)


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0():
    srv = launch("--graceful-shutdown-timeout", "5")  # >> the 30-token request, << the 3000-token one
    try:
        engine_pid = srv.engine_pid()
        results = {}

        def stream(name: str, body: dict):
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                lines = r.iter_lines()
                _first_token(lines)
                results[name + "_started"] = True
                results[name] = [line for line in lines if line.startswith("data: ")]

        threads = [threading.Thread(target=stream, args=("long", LONG)),
                   threading.Thread(target=stream, args=("short", {**LONG, "max_tokens": 30}))]
        threads[0].start()
        assert wait_for(lambda: results.get("long_started"), timeout=30)
        threads[1].start()
        assert wait_for(lambda: results.get("short_started"), timeout=30, interval=0.01)
        srv.proc.send_signal(signal.SIGTERM)  # both are in flight
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        assert "did not exit within" not in srv.log(), "the engine outlived its shutdown request and was killed"
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a request hung after SIGTERM"
        for name, finish in (("short", "length"), ("long", "abort")):
            *_, last_choice, usage, done = results[name]
            assert json.loads(last_choice[6:])["choices"][0]["finish_reason"] == finish, name
            assert done == "data: [DONE]"
        assert json.loads(results["short"][-2][6:])["usage"]["completion_tokens"] == 30
        assert wait_for(lambda: not _alive(engine_pid), timeout=10)
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
    finally:
        srv.stop()


def test_engine_crash_fails_health_and_requests_cleanly():
    srv = launch()
    try:
        engine_pid = srv.engine_pid()
        results = {}

        def streaming():
            with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                _first_token(lines)
                results["started"] = True
                results["stream"] = [line for line in lines if line.startswith("data: ")]

        def whole():
            results["whole"] = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60)

        threads = [threading.Thread(target=streaming), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert wait_for(lambda: results.get("started"), timeout=30)
        os.kill(engine_pid, signal.SIGKILL)
        for t in threads:
            t.join(20)
            assert not t.is_alive(), "a request hung after the engine died"
        assert results["whole"].status_code == 500 and results["whole"].json()["error"]["code"] == "engine_failed"
        assert "rank 0 failed" in results["whole"].json()["error"]["message"]
        assert "error" in json.loads(results["stream"][-2][6:]) and results["stream"][-1] == "data: [DONE]"
        # Nothing is left to serve with: the server exits non-zero (for a supervisor to restart it),
        # naming the rank that died.
        assert srv.proc.wait(timeout=30) == 2  # EngineDied: a one-line error, exit 2 (docs/serving.md)
        assert re.search(r"rank 0 \(pid \d+\) failed: killed by SIGKILL", srv.log()), srv.log()
    finally:
        srv.stop()
