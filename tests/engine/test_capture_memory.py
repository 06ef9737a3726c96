"""A start-up capture that runs out of GPU memory stops with the room it had and the flags that give more."""

import pytest
import torch

from engine.errors import GpuMemoryError
from engine.runner.capture_memory import told_out_of_memory

H200 = 150.75e9


@pytest.mark.parametrize("failure", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("NCCL error: unhandled cuda error ... Last error: Cuda failure 'out of memory'"),
])
def test_out_of_memory_in_a_capture_names_the_room_and_the_fixes(failure):
    with pytest.raises(GpuMemoryError) as err:
        with told_out_of_memory("the piecewise CUDA graphs of extend steps up to 8192 tokens", H200, 0.93,
                                "--piecewise-cuda-graph-max-tokens 4096, or 0 for none"):
            raise failure
    msg = str(err.value)
    assert msg == ("capturing the piecewise CUDA graphs of extend steps up to 8192 tokens ran out of GPU memory: "
                   "activations and CUDA graphs have the 10.6 GB outside --mem-fraction-static 0.93 of this 151 GB "
                   "GPU; give them more room with --mem-fraction-static 0.91 (a smaller KV pool), or capture less: "
                   "--piecewise-cuda-graph-max-tokens 4096, or 0 for none")
    assert err.value.__cause__ is failure


def test_other_failures_and_cpu_pass_unchanged():
    with pytest.raises(ValueError, match="a bug"):
        with told_out_of_memory("x", H200, 0.9, "y"):
            raise ValueError("a bug")
    oom = torch.OutOfMemoryError("out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        with told_out_of_memory("x", None, 0.9, "y"):  # no GPU: nothing to advise about
            raise oom
