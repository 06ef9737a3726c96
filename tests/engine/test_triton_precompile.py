"""CPU side of the parallel Triton precompile (engine/triton_precompile.py; the GPU test is
tests/gpu/test_triton_precompile.py): flag checks, the worker share, and that a failing compile is
logged and left to the capture instead of stopping start-up."""

import logging

import pytest

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.triton_precompile import Specialisation, compile_all, default_workers


def test_flag_rejects_negative_workers():
    with pytest.raises(UsageError, match="--triton-compile-workers"):
        EngineArgs.of(model="tiny", triton_compile_workers=-1).validate()
    EngineArgs.of(model="tiny", triton_compile_workers=0).validate()


def test_workers_are_shared_between_ranks_of_a_node():
    alone = default_workers(1)
    assert alone >= 1
    assert default_workers(8) == max(1, alone // 8)


def test_failed_compile_is_logged_not_raised(caplog):
    spec = Specialisation("engine.no_such_module", "kernel", "{}", "/nonexistent/marker")
    with caplog.at_level(logging.WARNING, logger="engine.triton_precompile"):
        assert compile_all([spec], workers=1) == 0
    assert "compiles at capture instead" in caplog.text
    assert compile_all([], workers=4) == 0
