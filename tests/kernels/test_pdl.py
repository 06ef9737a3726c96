"""Programmatic dependent launch (kernels/pdl.py, --pdl): the launch options follow the process's setting, and
the engine refuses --pdl on where it cannot run. That every PDL-aware kernel compiles for sm_90 with its wait is
tests/kernels/smem_probe.py's (test_shared_memory.py); that outputs do not change with it is
tests/gpu/test_pdl_gpu.py's."""

import pytest
import torch

from engine.engine import Engine
from engine.errors import UsageError
from kernels import pdl


def test_launch_options_follow_the_setting():
    before = pdl.enabled()
    try:
        pdl.set_enabled(True)
        assert pdl.launch_options() == {"PDL": True, "launch_pdl": True}
        pdl.set_enabled(False)
        assert pdl.launch_options() == {}
    finally:
        pdl.set_enabled(before)


def test_not_supported_off_cuda():
    assert "CUDA" in pdl.supported(torch.device("cpu"))


def test_engine_turns_it_off_on_cpu_and_refuses_on():
    eng = Engine(model="tiny", device="cpu", max_total_tokens=1024)
    try:
        assert not pdl.enabled()
    finally:
        eng.close()
    with pytest.raises(UsageError, match="--pdl on: .*use --pdl auto"):
        Engine(model="tiny", device="cpu", max_total_tokens=1024, pdl="on")
