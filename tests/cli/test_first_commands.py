"""The commands a new user types first, exactly as typed (issue 18): `dsctl download deepseek-v3` with no
network, `dsctl tune-moe --tp 8` with no GPU, `dsctl bench --batch-size 1`. (`dsctl serve
--enable-dp-attention` belongs to the parallelism work.)"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import torch

from dsctl import hub_download
from dsctl.hub_fetch import RetryPolicy
from tests.cli.screen import run_dsctl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(res) -> str:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    return errors[0]


# --- dsctl download deepseek-v3, no network ----------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["http://dsctl-no-such-host.invalid", "http://127.0.0.1:{port}"],
                         ids=["name-resolution", "connection-refused"])
def test_download_without_network_fails_fast_and_says_what_to_check(endpoint, tmp_path):
    endpoint = endpoint.format(port=_free_port())
    start = time.monotonic()
    res = run_dsctl("download", "deepseek-v3", timeout=60,
                    env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")})
    elapsed = time.monotonic() - start
    line = _one_line_error(res)
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert endpoint in line
    for needle in ("network", "HF_ENDPOINT", "mirror", "HF_HUB_OFFLINE"):
        assert needle in line, line
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("*.safetensors*"))


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _failing(times: int, then="ok"):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= times:
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        return then

    return fn, calls


def test_first_contact_connection_failures_stop_after_a_few_quick_tries():
    clock = _Clock()
    call = hub_download._api_caller(RetryPolicy(retries=20, wait=1.0), log=lambda msg: None, clock=clock,
                                    sleep=clock.sleep)
    fn, calls = _failing(100)
    with pytest.raises(hub_download.HubUnreachable, match="HF_ENDPOINT"):
        call(fn)
    assert len(calls) == hub_download.FIRST_CONTACT_TRIES
    assert clock.now <= hub_download.FIRST_CONTACT_BUDGET_S


def test_a_short_outage_on_first_contact_is_still_ridden_out():
    clock = _Clock()
    call = hub_download._api_caller(RetryPolicy(retries=20, wait=1.0), log=lambda msg: None, clock=clock,
                                    sleep=clock.sleep)
    fn, calls = _failing(hub_download.FIRST_CONTACT_TRIES - 1)
    assert call(fn) == "ok" and len(calls) == hub_download.FIRST_CONTACT_TRIES


def test_once_the_hub_has_answered_connection_errors_keep_every_retry():
    clock = _Clock()
    policy = RetryPolicy(retries=6, wait=1.0)
    call = hub_download._api_caller(policy, log=lambda msg: None, clock=clock, sleep=clock.sleep)
    assert call(lambda: "model info") == "model info"  # first contact answered
    fn, calls = _failing(policy.retries)  # fails 6 times, then answers
    assert call(fn) == "ok" and len(calls) == policy.retries + 1
    fn, calls = _failing(100)
    with pytest.raises(httpx.ConnectError):
        call(fn)
    assert len(calls) == policy.retries + 1


def test_first_contact_bounds_only_the_connect_time():
    """A black-holed address would otherwise hang for the OS's connect timeout (minutes); reads stay unbounded."""
    from dsctl.hub_repo import CONNECT_TIMEOUT_S, _connect_timeout

    timeout = _connect_timeout(CONNECT_TIMEOUT_S)
    connect, read = (timeout if isinstance(timeout, tuple) else (timeout.connect, timeout.read))
    assert connect == CONNECT_TIMEOUT_S <= 10 and read is None


# --- dsctl tune-moe --tp 8 / tune-fp8 -------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when there is no GPU")
@pytest.mark.parametrize("command", ["tune-moe", "tune-fp8"])
def test_tune_without_gpu_stops_at_once_with_one_line(command):
    start = time.monotonic()
    res = run_dsctl(command, "--tp", "8", env={"TRITON_INTERPRET": "0"}, timeout=60)
    line = _one_line_error(res)
    assert time.monotonic() - start < 30
    assert line == (f"error: {command} needs a CUDA GPU; `--dry-run` lists the shapes it would tune "
                    "(model deepseek-v3, TP 8)")
    assert res.stdout.strip() == ""


@pytest.mark.parametrize("command", ["tune-moe", "tune-fp8"])
def test_tune_defaults_to_deepseek_v3_and_says_so(command):
    res = run_dsctl(command, "--tp", "8", "--dry-run", "--batch-sizes", "1", columns=200, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"{command}: deepseek-v3 (deepseek-ai/DeepSeek-V3): 61 layers, hidden 7168"), first
    assert "at TP 8" in first and "the default, pass --model to tune another" in first
    if command == "tune-moe":
        assert "E=256 N=256 K=7168 top-8" in res.stdout  # V3's experts split over TP 8
    res = run_dsctl(command, "--model", "deepseek-r1", "--tp", "4", "--dry-run", "--batch-sizes", "1",
                    columns=200, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"{command}: deepseek-r1") and "at TP 4" in first and "the default" not in first


# --- dsctl bench --batch-size 1 ---------------------------------------------------------------------------

def test_bench_without_sub_command_is_one_batch(tmp_path):
    """Every one-batch option works on plain `bench` (the multi-value form included); `bench serving` and
    `bench --help` are untouched."""
    out = tmp_path / "one-batch.jsonl"
    res = run_dsctl("bench", "--batch-size", "1", "2", "--input-len", "8", "--output-len", "3", "--repeats", "1",
                    "--device", "cpu", "--result-file", out, columns=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "bench one-batch" in res.stdout
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["input_len"], r["output_len"], r["repeats"]) for r in rows] == [(1, 8, 3, 1),
                                                                                               (2, 8, 3, 1)]
    res = run_dsctl("bench", "--help")
    assert res.returncode == 0 and "one-batch" in res.stdout and "serving" in res.stdout
    res = run_dsctl("bench", "serving", "--num-prompts", "1")
    assert res.returncode != 0 and "--base-url" in res.stderr  # serving is still its own command
