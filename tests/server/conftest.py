"""Live `dsctl serve` subprocesses for the server tests (tiny model, CPU, 127.0.0.1, a free port).

`launch(*flags)` starts one and waits for /health; `server` is the shared one
(session-scoped: every module that only needs an ordinary server uses it).
Servers are killed at teardown; their output goes to a log file that failing
tests print.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny-served"
STARTUP_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, body=None, content=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, content=content, headers={**self.headers, **kw.pop(
            "headers", {})}, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                         timeout=kw.pop("timeout", 30), **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (name -> value); labelled ones keep their labels in the name."""
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def engine_pid(self) -> int:
        return self.get("/health").json()["engine_pid"]

    def stop(self) -> None:
        """SIGTERM (the server stops its engine process), SIGKILL both if that takes too long."""
        if self.proc.poll() is not None:
            return
        children = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except FileNotFoundError:
        return []
    return [int(x) for x in out]


def launch(*flags: str, api_key: str | None = None) -> Server:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="dsctl-serve-", suffix=".log", delete=False)
    model = () if "--model" in flags else ("--model", "tiny")  # the random model unless a test names one
    cmd = [sys.executable, "-m", "dsctl", "serve", "--port", str(port), *model, *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    # A CPU server runs its torch code paths; the Triton interpreter that tests/conftest.py turns on for the
    # kernel tests would only make it many times slower.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log.name, api_key)
    deadline = time.time() + STARTUP_S
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dsctl serve exited early ({proc.returncode}):\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    pytest.fail(f"dsctl serve did not become healthy in {STARTUP_S} s:\n{server.log()}")


@pytest.fixture(scope="session")
def server():
    """The shared server: API key and a served model name set, everything else default."""
    srv = launch("--served-model-name", MODEL_NAME, api_key=API_KEY)
    yield srv
    srv.stop()


def wait_for(predicate, timeout: float = 30, interval: float = 0.1):
    """Poll predicate() until it returns something truthy; return it (or the last value after timeout)."""
    deadline = time.time() + timeout
    value = predicate()
    while not value and time.time() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def kv_settled(srv: Server) -> bool:
    """No request running or waiting, and every KV slot is free apart from what the prefix cache holds."""
    m = srv.metrics()
    held = m.get("dsctl_prefix_cache_tokens", 0.0)
    return (m["dsctl_num_requests_running"] == 0 and m["dsctl_num_requests_waiting"] == 0
            and m["dsctl_kv_cache_free_tokens"] + held == m["dsctl_kv_cache_total_tokens"])
