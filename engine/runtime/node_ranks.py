"""A node other than 0 of a multi-node job (--nnodes N --node-rank R > 0): its engine ranks and nothing else.

They join node 0's world and run until node 0 stops them (SIGTERM stops them too); a rank that
fails ends the process non-zero with its error.
"""

from __future__ import annotations

import logging
import signal

from engine.args import EngineArgs
from engine.errors import DsctlError
from engine.runtime.ranks import EngineRanks

log = logging.getLogger("dsctl.server")


class EngineRanksFailed(DsctlError):
    """An engine rank of this node failed."""


def serve_ranks_only(args: EngineArgs) -> None:
    """Run this node's ranks until they exit; SIGTERM stops them."""
    pc = args.parallel.config()
    ranks = EngineRanks.start_engine(args)  # the pipes go to world rank 0, which is on node 0: unused here
    log.info("node %d: engine ranks %d..%d started (pids %s), joining %s", pc.node_rank, pc.global_rank(0),
             pc.global_rank(pc.ranks_per_node - 1), ranks.pids, pc.dist_init_addr)
    stopping: list[int] = []

    def on_sigterm(*_) -> None:
        stopping.append(1)
        ranks.stop(grace=2.0)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        failure = ranks.wait()
    except KeyboardInterrupt:
        ranks.stop()
        return
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failure is not None and not stopping:
        raise EngineRanksFailed(f"engine {failure.message()}")
