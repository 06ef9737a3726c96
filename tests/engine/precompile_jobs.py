"""Stand-in compile jobs for tests/engine/test_triton_precompile.py (module level, so that spawned
background workers can import them)."""

import os
import signal
import time

from engine.runner.triton_precompile import BackgroundCompiles, Specialisation


def leave_marker(module: str, name: str, data: str, marker: str) -> None:
    with open(marker, "w"):
        pass


def compile_forever(module: str, name: str, data: str, marker: str) -> None:
    with open(marker + ".started", "w"):
        pass
    time.sleep(600)


def end_with_background_compiles(tmp: str, compiling: bool, cancel: bool) -> None:
    """A process (an engine rank) that ends while its background workers compile (`compiling`) or after
    they finished, with or without cancelling them first. Like `engine_main`, it ignores SIGTERM and SIGINT
    (the serving process handles those), and its spawned workers inherit that."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    specs = [Specialisation("m", f"k{i}", "{}", os.path.join(tmp, f"k{i}")) for i in range(3)]
    bg = BackgroundCompiles(specs, workers=2, niceness=0, job=compile_forever if compiling else leave_marker)
    deadline = time.monotonic() + 60
    if compiling:
        while sum(os.path.exists(s.marker + ".started") for s in specs) < 2:  # both workers are inside a job
            assert time.monotonic() < deadline, "the background workers did not start their jobs"
            time.sleep(0.05)
    else:
        assert bg.wait() == 3
    if cancel:
        bg.cancel()
