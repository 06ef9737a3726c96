"""Server hardening through one real `dsctl serve` process (tiny, CPU): the API key from the environment,
the limits under concurrency, /health while a huge prompt is checked, and the two-signal shutdown.

The server runs one sequence at a time with room for two more in the queue, so a long stream holds the
engine while the tests fill the queue. The last test shuts the server down (it must stay last).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import launch, wait_for

KEY = "env-only-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "a long one", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
MAX_PROMPT_TOKENS = 4000


@pytest.fixture(scope="module")
def srv():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSCTL_API_KEY", KEY)
        server = launch("--max-running-requests", "1", "--max-queued-requests", "2", "--max-body-bytes", "2000000",
                        "--max-request-prompt-tokens", str(MAX_PROMPT_TOKENS), "--graceful-shutdown-timeout", "60")
    yield server
    server.stop()


def _post(srv, path, body=None, **kw):
    return httpx.post(srv.url + path, json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)


class _Stream:
    """A streamed completion read in a thread over a plain socket (so that `close` can cut it from here):
    its SSE data lines, and whether generated text has arrived."""

    def __init__(self, srv, body: dict):
        host, port = srv.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        self.lines: list[str] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for raw in self.sock.makefile("rb"):
                line = raw.decode("utf-8", "replace").strip()
                if line.startswith("data: "):
                    self.lines.append(line)
                    if '"text": "' in line and '"text": ""' not in line:
                        self.started.set()
                if line == "data: [DONE]":
                    return
        except OSError:
            pass

    def close(self):
        """Cut the connection (the server sees a client that left and aborts the request)."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)
        self.sock.close()

    def finish_reason(self):
        return json.loads(self.lines[-2][6:])["choices"][0]["finish_reason"]


def test_api_key_comes_from_the_environment_and_health_says_little_without_it(srv):
    with open(f"/proc/{srv.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    bare = httpx.get(srv.url + "/health", timeout=10)
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    full = httpx.get(srv.url + "/health", headers=AUTH, timeout=10).json()
    assert full["status"] == "ok" and full["engine_pid"] > 0
    for path in ("/v1/models", "/metrics", "/nope"):
        assert httpx.get(srv.url + path, timeout=10).status_code == 401, path
        assert httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 401
    assert httpx.get(srv.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_listen_url_is_logged_once_when_ready(srv):
    lines = [line for line in srv.log().splitlines() if "ready: serving" in line]
    assert len(lines) == 1 and srv.url in lines[0], lines


def test_limits_under_concurrency_and_health_stays_fast(srv):
    running = _Stream(srv, LONG)
    assert running.started.wait(30)
    queued = [_Stream(srv, LONG) for _ in range(2)]
    assert wait_for(lambda: _metric(srv, "dsctl_num_requests_queued") == 2, timeout=20)
    full = _post(srv, "/v1/completions", {"prompt": "one too many", "max_tokens": 2})
    assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1, full.text
    assert full.json()["error"]["type"] == "service_unavailable_error"
    # A body over --max-body-bytes: 413 with a JSON error.
    big = _post(srv, "/v1/completions", content=b'{"prompt": "' + b"x" * 2_100_000 + b'"}',
                headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    # 0.8 MB of prompts are tokenised off the event loop: /health keeps answering at once meanwhile, and
    # the request is refused for its prompt tokens in all (each prompt fits the context on its own).
    result = {}
    huge = threading.Thread(target=lambda: result.update(r=_post(srv, "/v1/completions", {
        "prompt": ["def f(x): return x  # " * 150] * 250, "max_tokens": 1})))
    huge.start()
    slowest = 0.0
    while huge.is_alive():
        t = time.perf_counter()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.perf_counter() - t)
        time.sleep(0.05)
    huge.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "too_many_prompt_tokens"
    assert slowest < 1.0, f"/health took {slowest:.2f}s while a huge prompt was tokenised"
    deep = _post(srv, "/v1/completions", content=b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}")
    assert deep.status_code == 400 and "nested" in deep.json()["error"]["message"]
    assert running.thread.is_alive() and all(q.thread.is_alive() for q in queued)  # nothing else was disturbed
    for stream in (running, *queued):
        stream.close()


def _metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return -1.0


def test_sigterm_drains_then_a_second_signal_ends_the_rest_at_once(srv):
    """Must run last: it shuts the module's server down."""
    assert wait_for(lambda: _metric(srv, "dsctl_num_requests_queued") <= 0
                    and _metric(srv, "dsctl_num_requests_running") == 0, timeout=30), "the previous test left work"
    short = _Stream(srv, {**LONG, "max_tokens": 20})
    assert short.started.wait(30)
    long = _Stream(srv, LONG)  # queued behind the short one (one sequence at a time)
    assert wait_for(lambda: _metric(srv, "dsctl_num_requests_queued") == 1, timeout=20)
    srv.proc.send_signal(signal.SIGTERM)
    short.thread.join(30)
    assert not short.thread.is_alive() and short.finish_reason() == "length", short.lines[-3:]
    assert short.lines[-1] == "data: [DONE]"
    assert long.started.wait(30)  # the drain lets the queued request run
    try:  # no new requests while draining: refused, or the listener is already closed
        assert _post(srv, "/v1/completions", {"prompt": "late", "max_tokens": 2}).status_code == 503
    except httpx.TransportError:
        pass
    t = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(timeout=30) == 0, srv.log()
    assert time.monotonic() - t < 15, "a second signal must end the server at once"
    long.thread.join(10)
    assert long.finish_reason() == "abort" and long.lines[-1] == "data: [DONE]"
    assert "Traceback" not in srv.log(), srv.log()
