"""init_parallel in this process: a world of one needs no torch.distributed, and a rank whose peers
never come fails within --dist-timeout with a one-line message naming the rank and the address."""

import time

import pytest
import torch

from engine.distributed.groups import DistInitError, init_parallel
from engine.distributed.parallel_config import ParallelConfig
from engine.runtime.launch import free_port


def test_world_of_one_is_the_single_process_state():
    state = init_parallel(ParallelConfig(), 0, "cpu")
    assert (state.world_rank, state.world_size, state.tp.size, state.backend) == (0, 1, 1, None)
    assert not torch.distributed.is_initialized()
    state.destroy()


def test_missing_peer_times_out_with_a_clear_message():
    pc = ParallelConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=1.0)
    t = time.monotonic()
    with pytest.raises(DistInitError) as exc:
        init_parallel(pc, 0, "cpu")
    assert time.monotonic() - t < 10
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"rank 0 could not join the 2-rank world at {pc.init_method()} within --dist-timeout 1s")
    assert not torch.distributed.is_initialized()
