"""engine/runtime/profiling.py: the interval sums behind each rank's communication figures, and one rank's
profile on CPU (the trace it writes, what it counts). The routes over a TP 2 + DP 2 server (both ranks' traces,
gloo's collectives counted) are in tests/distributed/test_serve_tp.py's DP-attention server test."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.runtime.profiling import RankProfiler, length, merged, overlap, summarize, trace_events

spans = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)).map(lambda t: (float(t[0]), float(t[0] + t[1]))),
                 max_size=12)


def _covered(intervals, t: float) -> bool:
    return any(s <= t < e for s, e in intervals)


@given(spans, spans)
def test_union_and_overlap_equal_counting_every_time_step(a, b):
    """On integer-aligned intervals, the union's length and the overlap of two unions equal a count over every
    unit of time (a reference written without interval arithmetic)."""
    ma, mb = merged(a), merged(b)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(ma, ma[1:]))  # disjoint, ordered, not touching
    assert length(ma) == sum(_covered(a, t + 0.5) for t in range(260))
    assert overlap(ma, mb) == sum(_covered(a, t + 0.5) and _covered(b, t + 0.5) for t in range(260))


def test_exposed_communication_is_what_runs_alone():
    events = [("gemm", 0.0, 100.0), ("ncclDevKernel_AllReduce_Sum_bf16", 80.0, 130.0),
              ("_one_shot_kernel", 150.0, 160.0), ("fused_moe", 155.0, 200.0), ("gloo:all_reduce", 300.0, 310.0)]
    s = summarize(3, events, "cuda kernels")
    assert (s.rank, s.source, s.span_ms) == (3, "cuda kernels", 0.31)
    assert s.comm_ms == pytest.approx(0.070)  # 50 + 10 + 10 us of collectives
    assert s.exposed_comm_ms == pytest.approx(0.045)  # 30 (100..130) + 5 (150..155) + 10 alone
    assert s.busy_ms == pytest.approx(0.190)  # 0..130, 150..200, 300..310
    assert summarize(0, [], "cpu ops").comm_ms == 0.0


def test_a_trace_is_read_back_as_kernels_or_top_level_host_ops(tmp_path):
    """A GPU trace: its kernels (every stream), host ops ignored. A CPU trace: each thread's outermost ops, so an
    op inside a collective (or a collective inside a Python-level op) is not counted twice."""
    def op(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}

    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"traceEvents": [op("aten::mm", 0, 50), op("gemm", 5, 40, "kernel", 7),
                                               op("ncclDevKernel_AllReduce", 30, 20, "kernel", 8),
                                               {"ph": "M", "name": "process_name"}]}))
    events, source = trace_events(str(gpu))
    assert source == "cuda kernels" and sorted(events) == [("gemm", 5.0, 45.0), ("ncclDevKernel_AllReduce", 30.0, 50.0)]
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": [op("c10d::allreduce_", 0, 30), op("aten::empty", 2, 3),
                                               op("aten::mm", 40, 10), op("aten::add", 41, 2), op("aten::mm", 5, 10, tid=2)]}))
    events, source = trace_events(str(cpu))
    assert source == "cpu ops" and sorted(events) == [("aten::mm", 5.0, 15.0), ("aten::mm", 40.0, 50.0),
                                                      ("c10d::allreduce_", 0.0, 30.0)]
    s = summarize(0, events, source)
    assert s.comm_ms == pytest.approx(0.030) and s.exposed_comm_ms == pytest.approx(0.020)  # 5..15 overlaps


def test_a_cpu_rank_writes_its_trace_and_counts_its_ops(tmp_path):
    prof = RankProfiler(str(tmp_path / "profiles"), 1, torch.device("cpu"))
    assert prof.stop() is None and not prof.due  # nothing active: nothing to stop
    prof.count_step()  # not recording: not counted
    prof.start("s1", max_steps=3)
    x = torch.randn(64, 64)
    for _ in range(3):
        assert not prof.due
        x = torch.tanh(x @ x)
        prof.count_step()
    assert prof.due  # its steps run: rank 0 sends every rank the stop
    s = prof.stop()
    assert s.steps == 3 and not prof.active and not prof.due
    assert not s.error and s.source == "cpu ops" and s.trace.endswith("s1-rank1.trace.json")
    names = {e.get("name") for e in json.loads(open(s.trace).read())["traceEvents"]}
    assert "aten::matmul" in names or "aten::mm" in names
    assert s.busy_ms > 0 and s.comm_ms == 0.0 and s.exposed_comm_ms == 0.0


def test_the_one_rank_loop_ends_a_profile_after_its_steps(tmp_path):
    """The loop of a one-process engine (no TP): a profile asked for 3 steps stops by itself after the 3rd while
    the request goes on, says so, and a later StopProfile (none active) is ignored."""
    import threading
    import time
    from multiprocessing import Pipe

    from engine.engine import Engine
    from engine.runtime.protocol import AddRequest, ProfileWritten, Shutdown, StartProfile, StepOutputs, StopProfile
    from engine.runtime.rank_loop import EngineLoop
    from engine.sampling import SamplingParams

    engine = Engine(model="tiny", device="cpu", dtype="float32", profile_dir=str(tmp_path))
    sent = []
    outbox = type("Outbox", (), {"send": lambda self, msg: sent.append(msg)})()
    inbox, feed = Pipe(duplex=False)
    feed.send(StartProfile("p1", max_steps=3))
    feed.send(AddRequest("r0", [5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)))

    def finish():  # once the request is done: a stop with nothing active, then the end
        deadline = time.time() + 60
        while time.time() < deadline and not any(o.finished for m in sent if isinstance(m, StepOutputs)
                                                  for o in m.outputs):
            time.sleep(0.05)
        feed.send(StopProfile())
        feed.send(Shutdown())

    threading.Thread(target=finish, daemon=True).start()
    EngineLoop(engine, outbox).run(inbox)
    written = [m for m in sent if isinstance(m, ProfileWritten)]
    assert len(written) == 1 and written[0].ran_its_steps and written[0].stamp == "p1"
    (rank,) = written[0].ranks
    assert rank["steps"] == 3 and not rank["error"] and (tmp_path / "p1-rank0.trace.json").exists()
    tokens = [t for m in sent if isinstance(m, StepOutputs) for o in m.outputs for t in o.new_token_ids]
    assert len(tokens) == 10  # the request went on past the profile
