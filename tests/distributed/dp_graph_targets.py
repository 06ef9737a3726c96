"""Engine factories for spawned ranks (engine_main's `make_engine`) in the DP-attention padded-decode tests.

`padded_decode_engine` builds the normal Engine and then routes its decode batches through the CUDA
graph runner's padded static batches with capture=False: the same padding, per-size batches, graph-size
agreement between DP groups and idle padding replays as on a GPU, run eagerly on the CPU.
"""

from __future__ import annotations

from engine.engine import Engine

PADDED_SIZES = [1, 2, 4, 8]


def padded_decode_engine(args, local_rank: int) -> Engine:
    engine = Engine(args, local_rank=local_rank)
    engine.runner.build_graph_runner(PADDED_SIZES, capture=False)
    return engine


def padded_spec_engine(args, local_rank: int) -> Engine:
    """The same for speculative decoding: its tree forwards (up to 8 rows per request) through padded
    batches of the model's and the MTP layer's graph runners, larger ones eagerly."""
    engine = Engine(args, local_rank=local_rank)
    engine.runner.build_graph_runner([1, 2, 4, 8, 16, 32], capture=False)
    return engine
