"""`dsctl serve --tp 2` on CPU (gloo): the OpenAI API over two engine ranks, and how it fails and stops.

Also DP attention (`--tp 2 --enable-dp-attention --dp 2`, with EP, redundant experts and routing counts): the
same greedy completions, 64 concurrent streams with no failure, requests spread over both DP groups (per-group
counters in /metrics), and the expert load in /metrics and GET /expert_load.

Also the two-node form: two `dsctl serve` launches (--nnodes 2 --node-rank 0|1) on 127.0.0.1
form one TP-2 world; node 0 serves HTTP, node 1 runs a rank only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.server.conftest import free_port, launch, wait_for

PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5", "def fibonacci(n):"]


def _greedy(srv) -> list[str]:
    client = srv.client()
    return [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def one_process_text():
    srv = launch("--device", "cpu")
    try:
        yield _greedy(srv)
    finally:
        srv.stop()


def _streams(srv, n: int) -> list:
    """n concurrent streamed completions; their texts or exceptions."""
    async def streams():
        client = srv.async_client()

        async def one(i):
            stream = await client.completions.create(model="tiny", prompt=f"stream {i}:", max_tokens=12,
                                                     temperature=0.7, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)

    return asyncio.run(streams())


def test_tp2_server_matches_one_process_and_takes_32_streams(one_process_text):
    srv = launch("--device", "cpu", "--tp", "2")
    try:
        pids = srv.get("/health").json()["engine_pids"]
        assert len(pids) == 2
        assert _greedy(srv) == one_process_text
        assert srv.get("/expert_load").status_code == 404  # counts not recorded: says which flag records them
        results = _streams(srv, 32)
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, failures[:3]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=10), "a rank outlived the server"
    finally:
        srv.stop()


def test_dp_attention_server_spreads_64_streams_over_both_groups(one_process_text, tmp_path):
    """With expert parallelism, redundant experts from a placement file and the routing counts recorded: /metrics
    shows each EP rank's expert load, GET /expert_load the counts per layer and expert, which `dsctl
    place-experts` turns into a placement again. Two-batch overlap on, splitting forwards from 8 tokens: the
    streams' batches run as two micro-batches, /metrics counts them, the routing counts stay whole. Two completions
    are profiled (POST /start_profile, /stop_profile): one stops itself after the steps asked for, one on request;
    both ranks write a trace and count their collectives."""
    from typer.testing import CliRunner

    from dsctl.cli import app
    from tests.distributed.test_engine_tp import _placement_file

    placement = _placement_file(tmp_path / "placement.json", "tiny", ep=2, redundant=2)
    srv = launch("--device", "cpu", "--tp", "2", "--enable-dp-attention", "--dp", "2", "--ep", "2",
                 "--expert-placement", placement, "--record-expert-load", "--enable-two-batch-overlap",
                 "--two-batch-overlap-min-tokens", "8", "--profile-dir", str(tmp_path / "profiles"))
    try:
        pids = srv.get("/health").json()["engine_pids"]
        assert len(pids) == 2
        assert "2 DP attention groups" in srv.log()  # the KV capacity, printed at start-up
        assert _greedy(srv) == one_process_text
        assert srv.post("/stop_profile").status_code == 400  # none started
        for bad in ({"num_steps": 0}, {"num_steps": 10_001}, {"num_steps": "3"}, {"num_steps": 2.5}, [3]):
            r = srv.post("/start_profile", bad)
            assert r.status_code == 400, (bad, r.text)
        assert srv.post("/start_profile", content=b'{"num_steps": ').status_code == 400  # not JSON
        started = srv.post("/start_profile", {"num_steps": 3})
        assert started.status_code == 200 and srv.post("/start_profile").status_code == 400  # one at a time
        srv.client().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8)  # > 3 steps: stops itself
        auto = wait_for(lambda: srv.post("/stop_profile").json(), timeout=30)
        assert auto["stopped"] == "num_steps reached" and [r["steps"] for r in auto["ranks"]] == [3, 3], auto
        assert srv.post("/stop_profile").status_code == 400  # given once
        started = srv.post("/start_profile")  # the default number of steps: stopped on request here
        assert started.status_code == 200 and started.json()["num_steps"] == 500
        srv.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)  # profiled on both ranks
        stopped = srv.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
        prof = stopped.json()
        assert prof["profile"] == started.json()["profile"] and prof["stopped"] == "on request"
        assert [r["rank"] for r in prof["ranks"]] == [0, 1]
        for r in prof["ranks"]:  # gloo's collectives (DP gathers, MoE all-reduces) counted on each rank
            assert not r["error"] and r["source"] == "cpu ops" and os.path.exists(r["trace"]), r
            assert 0 < r["exposed_comm_ms"] <= r["comm_ms"] < r["busy_ms"] <= r["span_ms"], r
            assert json.load(open(r["trace"]))["traceEvents"]
        assert sum(r["steps"] for r in prof["ranks"]) >= 2, prof  # its group's prefill and decode (the other: idle)
        results = _streams(srv, 64)
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, failures[:3]
        assert sum(1 for r in results if r) > 32  # streams produced text
        m = srv.metrics()
        sent = [m.get(f'dsctl_dp_requests_total{{dp_rank="{g}"}}', 0) for g in (0, 1)]
        assert all(n >= 16 for n in sent), sent  # total_tokens (the default): both groups served requests
        assert sum(sent) == 64 + len(PROMPTS) + 2, sent  # + the profiled completions
        used = [m.get(f'dsctl_dp_kv_cache_used_tokens{{dp_rank="{g}"}}', -1) for g in (0, 1)]
        assert all(n > 0 for n in used), used  # each group's prefix cache holds its finished streams
        assert all(f'dsctl_dp_kv_load_tokens{{dp_rank="{g}"}}' in m for g in (0, 1)), sorted(m)
        assert m["dsctl_two_batch_forwards_total"] > 0, sorted(m)
        # no graphs on CPU: every forward eager, the groups' own forwards summed (the idle ones not counted)
        assert m['dsctl_forwards_total{path="eager"}'] >= 64 and 'dsctl_forwards_total{path="piecewise"}' not in m
        async def burst():  # 32 at once: one collective answers them (the client coalesces), all get it
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await asyncio.gather(*(http.get("/expert_load") for _ in range(32)))

        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 32
        load = srv.get("/expert_load").json()
        assert load["ep_size"] == 2 and set(load["layers"]) == {"1", "2", "3", "4"}
        routed = [sum(load["layers"][k]["logical"]) for k in ("1", "2", "3")]
        assert routed[0] > 4 * 64 * 12 * 0.9 and len(set(routed)) == 1, routed  # top-4 x every token forwarded
        assert all(sum(v["ranks"]) == sum(v["logical"]) for v in load["layers"].values())
        m = srv.metrics()  # the periodic report (every 64 step outputs) has reached /metrics by now
        ranks = [m.get(f'dsctl_expert_load_tokens_total{{ep_rank="{r}"}}', 0) for r in (0, 1)]
        assert all(n > 0 for n in ranks) and m["dsctl_expert_load_imbalance"] >= 1.0, (ranks, sorted(m))
        (tmp_path / "load.json").write_text(json.dumps(load))
        out = CliRunner().invoke(app, ["place-experts", "--load", str(tmp_path / "load.json"), "--ep", "2",
                                       "--redundant", "2", "-o", str(tmp_path / "again.json")])
        assert out.exit_code == 0 and (tmp_path / "again.json").is_file(), out.output
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=10), "a rank outlived the server"
    finally:
        srv.stop()


def test_killing_a_rank_ends_the_server_with_its_name():
    srv = launch("--device", "cpu", "--tp", "2", "--dist-timeout", "30")
    try:
        pids = srv.get("/health").json()["engine_pids"]
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        code = srv.proc.wait(timeout=45)
        assert code != 0 and time.monotonic() - start < 30
        assert re.search(r"rank 1 \(pid \d+\) failed: killed by SIGKILL", srv.log()), srv.log()
        assert wait_for(lambda: not any(_alive(p) for p in pids), timeout=10)
    finally:
        srv.stop()


def test_two_nodes_form_one_tp2_world(one_process_text):
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", "tiny", "--device", "cpu", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    log = tempfile.NamedTemporaryFile("w", prefix="dsctl-node1-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    node1 = subprocess.Popen([sys.executable, "-m", "dsctl", "serve", *common, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        node0 = launch(*common, "--node-rank", "0")
        try:
            assert len(node0.get("/health").json()["engine_pids"]) == 1  # node 0 runs rank 0 only
            assert _greedy(node0) == one_process_text
            node0.proc.send_signal(signal.SIGTERM)
            assert node0.proc.wait(timeout=60) == 0, node0.log()
            assert node1.wait(timeout=30) == 0, open(log.name).read()  # rank 1 stops with node 0
        finally:
            node0.stop()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
