"""`dsctl serve` spawns the engine ranks before it loads the tokenizer and builds the app (engine/server/serve.py),
so that they start up meanwhile: a failure in between must stop them (no rank outlives the server that never
started), and the start-up clock the logs use counts from the process's start."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time

import pytest

from engine.args import EngineArgs
from engine.runtime.process_clock import process_age_s
from engine.server import serve as serve_module
from tests.server.conftest import free_port


def test_a_failure_after_the_launch_stops_the_ranks(monkeypatch):
    before = set(mp.active_children())
    launched = []

    def broken_tokenizer(path):
        launched.append(set(mp.active_children()) - before)  # the rank is already up when the tokenizer loads
        raise RuntimeError("tokenizer files unreadable")

    monkeypatch.setattr(serve_module, "load_tokenizer", broken_tokenizer)
    with pytest.raises(RuntimeError, match="tokenizer files unreadable"):
        serve_module.serve(EngineArgs.of(model="tiny", device="cpu", port=free_port(), max_total_tokens=256))
    assert len(launched) == 1 and len(launched[0]) == 1
    deadline = time.monotonic() + 10
    while set(mp.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(mp.active_children()) - before, "engine ranks left running"


def test_process_age_counts_from_the_process_start():
    code = ("import time; time.sleep(0.5); from engine.runtime.process_clock import process_age_s; "
            "print(process_age_s())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30
    assert process_age_s() > 0
