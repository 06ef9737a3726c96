"""`dsctl bench serving` against a real `dsctl serve` (tiny model, CPU): the two commands agree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import launch


@pytest.fixture(scope="module")
def server():
    srv = launch()
    yield srv
    srv.stop()


def _generated_total(srv) -> float:
    metrics = srv.metrics()
    assert "dsctl_generation_tokens_total" in metrics, "dsctl_generation_tokens_total missing from /metrics"
    return metrics["dsctl_generation_tokens_total"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serving_completes_every_request(server, endpoint, tmp_path):
    result = tmp_path / "bench.jsonl"
    before = _generated_total(server)
    out = subprocess.run([sys.executable, "-m", "dsctl", "bench", "serving", "--base-url", server.url,
                          "--endpoint", endpoint, "--num-prompts", "12", "--max-concurrency", "6",
                          "--random-input-len", "24", "--random-output-len", "6", "--result-file", str(result)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    row = json.loads(result.read_text().splitlines()[-1])
    assert row["completed"] == 12 and row["failed"] == 0
    # bench asks for exactly 6 tokens per request (ignore_eos) and counts them from the server's usage.
    assert row["output_tokens"] == 12 * 6
    assert row["input_tokens"] > 12 and row["duration_s"] > 0
    # The server's own counter saw the same tokens, plus the one token of the untimed probe that
    # checks the server takes token-id prompts (completions only: chat prompts are messages).
    probe = 1 if row["prompt_form"] == "ids" else 0
    assert row["prompt_form"] == ("ids" if endpoint == "completions" else "chat")
    assert _generated_total(server) - before == 12 * 6 + probe
