"""Collectives over real gloo worlds: 2 ranks on one node, and 4 ranks as 2 nodes x 2 on 127.0.0.1
(two supervisors, like two `--nnodes 2 --node-rank 0|1` launches). Each rank runs
comm_targets.comm_checks; the single-process fast path is checked in-process."""

from dataclasses import replace

import torch

from engine.distributed import comm
from engine.distributed.groups import single_process
from engine.distributed.parallel_config import ParallelConfig
from engine.runtime.launch import free_port, start_ranks
from tests.distributed import comm_targets


def run_world(pc: ParallelConfig, target=comm_targets.comm_checks, timeout: float = 120):
    """Start every node of `pc` from this process; return the failures (None for clean nodes)."""
    sups = [start_ranks(target, pc.ranks_per_node, (replace(pc, node_rank=node),),
                        first_rank=node * pc.ranks_per_node) for node in range(pc.nnodes)]
    try:
        return [s.wait(timeout=timeout) for s in sups]
    finally:
        for s in sups:
            s.stop()


def test_two_ranks():
    pc = ParallelConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=60)
    failures = run_world(pc)
    assert failures == [None], [f.message() + "\n" + f.details for f in failures if f]


def test_four_ranks_over_two_nodes():
    pc = ParallelConfig(tp_size=4, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=60)
    pc.validate()
    failures = run_world(pc)
    assert failures == [None, None], [f.message() + "\n" + f.details for f in failures if f]


def test_rank_failing_before_a_collective_is_named():
    pc = ParallelConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=30)
    (failure,) = run_world(pc, comm_targets.fail_in_collective, timeout=60)
    assert failure is not None and failure.rank == 1
    assert failure.reason == "RuntimeError: rank 1 ran out of memory (simulated)"


def test_single_process_fast_path_touches_nothing():
    g = single_process("cpu").tp
    assert (g.rank, g.size, g.is_first) == (0, 1, True)
    x = torch.randn(3, 4)
    assert comm.all_reduce(x, g) is x
    assert comm.all_gather_last_dim(x, g) is x
    assert comm.broadcast_tensor(x, 0, g) is x
    obj = {"a": 1}
    assert comm.broadcast_object(obj, 0, g) is obj
    assert comm.all_reduce_min_int(17, g) == 17
    comm.barrier(g)
    assert not torch.distributed.is_initialized()
