"""`dsctl bench serving` against a real `dsctl serve` (tiny model, CPU): the two commands agree."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the server runs torch on CPU
    proc = subprocess.Popen([sys.executable, "-m", "dsctl", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dsctl serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("dsctl serve did not become healthy in 180 s")
    yield url
    proc.terminate()
    proc.wait(timeout=60)


def _generated_total(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dsctl_generation_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("dsctl_generation_tokens_total missing from /metrics")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serving_completes_every_request(server, endpoint, tmp_path):
    result = tmp_path / "bench.jsonl"
    before = _generated_total(server)
    out = subprocess.run([sys.executable, "-m", "dsctl", "bench", "serving", "--base-url", server,
                          "--endpoint", endpoint, "--num-prompts", "12", "--max-concurrency", "6",
                          "--random-input-len", "24", "--random-output-len", "6", "--result-file", str(result)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    row = json.loads(result.read_text().splitlines()[-1])
    assert row["completed"] == 12 and row["failed"] == 0
    # bench asks for exactly 6 tokens per request (ignore_eos) and counts them from the server's usage.
    assert row["output_tokens"] == 12 * 6
    assert row["input_tokens"] > 12 and row["duration_s"] > 0
    # The server's own counter saw the same tokens.
    assert _generated_total(server) - before == 12 * 6
