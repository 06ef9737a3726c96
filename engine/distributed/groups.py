"""torch.distributed set-up for one rank process: the world, its TP group, and tear-down.

`init_parallel(config, local_rank, device_type)` joins the world through
"tcp://HOST:PORT" (no environment variables), NCCL on CUDA and gloo on CPU, and returns a
`ParallelState`: this rank's place in the world and its `TPGroup`. Nothing is kept in module
globals: pass the state (or its `tp` group) to whoever runs collectives, e.g. the model's
forward context. `single_process(device)` is the same object for an unsplit run (size 1,
no torch.distributed at all), so callers never branch on "is TP on".

Each group has two process groups over the same ranks:
- `device_group` for tensor collectives (NCCL on CUDA, gloo on CPU);
- `cpu_group`, always gloo, for host-side objects (scheduler messages, small ints). It is a
  separate group even on CPU so that a thread broadcasting scheduler messages never
  interleaves with the forward's collectives on the same communicator.

A warm-up all-reduce at the end of `init_parallel` proves every rank joined and creates the
NCCL communicator before any CUDA graph is captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.distributed.parallel_config import ParallelConfig
from engine.errors import DsctlError


class DistInitError(DsctlError):
    """This rank could not join the torch.distributed world (unreachable address, timeout, ...)."""


@dataclass
class TPGroup:
    """One tensor-parallel group as seen by one of its ranks.

    The model's group (the world) also says how the other layouts cut it: `ep_size` ranks split the
    routed experts (1, or the group size: each rank owns experts / size whole experts), and with DP
    attention `attn` is this rank's attention-TP group, one of `dp_size` groups of size / dp_size
    consecutive ranks (`dp_rank` = which), running attention, embedding and lm_head on its own tokens
    while the dense MLPs and the MoE stay split over the whole group."""

    rank: int  # rank inside the group, 0..size-1
    size: int
    ranks: tuple[int, ...]  # world ranks of the members, in group-rank order
    device_group: Any = None  # torch ProcessGroup for tensors (None when size == 1)
    cpu_group: Any = None  # gloo ProcessGroup for host objects (None when size == 1)
    ep_size: int = 1  # ranks that split the routed experts by whole experts (1: split by intermediate size)
    attn: Optional["TPGroup"] = None  # DP attention: this rank's attention-TP group (None: this group)
    dp_size: int = 1  # DP attention groups in this group
    dp_rank: int = 0  # this rank's DP group
    moe_a2a: str = "none"  # --moe-a2a-backend: how MoE tokens reach the experts' ranks ("none": gather / all-reduce)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def world_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    @property
    def attention(self) -> "TPGroup":
        """The group attention, embedding and lm_head are split over (this group unless DP attention)."""
        return self.attn if self.attn is not None else self

    @property
    def exchanges_tokens(self) -> bool:
        """MoE layers send each token to its experts' ranks by all-to-all (engine/distributed/token_exchange.py);
        the shared experts are then whole on every rank, which runs them on its own tokens."""
        return self.moe_a2a != "none"

    @property
    def ep_rank(self) -> int:
        """Which block of n_routed_experts / ep_size experts this rank owns (0 without EP)."""
        return self.rank if self.ep_size > 1 else 0


@dataclass
class ParallelState:
    """This process's place in the world. Extension point: DP-attention and EP groups join `tp` here."""

    world_rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: TPGroup
    backend: Optional[str] = None  # "nccl" | "gloo" | None (single process)
    owns_world: bool = False  # True when this state called init_process_group (destroy() undoes it)

    def destroy(self) -> None:
        """Leave the world (idempotent). Every rank should call it before exiting cleanly."""
        if not self.owns_world:
            return
        self.owns_world = False
        if dist.is_initialized():
            dist.destroy_process_group()


def single_process(device: torch.device | str = "cpu") -> ParallelState:
    """The state of an unsplit run: TP size 1, no torch.distributed."""
    return ParallelState(world_rank=0, world_size=1, local_rank=0, device=torch.device(device),
                         tp=TPGroup(rank=0, size=1, ranks=(0,)))


def _attention_group(rank: int, world: int, dp: int, timeout: timedelta) -> TPGroup:
    """This rank's attention-TP group under DP attention: world / dp consecutive ranks. Every rank
    creates every group's process groups, in the same order (torch.distributed requires it)."""
    size = world // dp
    mine = None
    for g in range(dp):
        members = list(range(g * size, (g + 1) * size))
        groups = (dist.new_group(members, timeout=timeout), dist.new_group(members, backend="gloo", timeout=timeout)) \
            if size > 1 else (None, None)
        if rank in members:
            mine = TPGroup(rank=rank - g * size, size=size, ranks=tuple(members), device_group=groups[0],
                           cpu_group=groups[1])
    return mine


def init_parallel(config: ParallelConfig, local_rank: int, device_type: str = "cpu") -> ParallelState:
    """Join the world as this node's `local_rank` and build the TP group (all world ranks, for now)."""
    rank, world = config.global_rank(local_rank), config.world_size
    if device_type == "cuda":
        device = torch.device("cuda", config.gpu_id(local_rank))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world == 1:
        return single_process(device)
    timeout = timedelta(seconds=config.dist_timeout)
    url = config.init_method()
    try:
        dist.init_process_group(backend, init_method=url, world_size=world, rank=rank, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    except Exception as exc:  # noqa: BLE001 - any rendezvous failure is reported the same way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistInitError(f"rank {rank} could not join the {world}-rank world at {url} within "
                            f"--dist-timeout {config.dist_timeout:g}s: {first}") from None
    ranks = tuple(range(world))
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
    dp = config.dp_size if config.enable_dp_attention else 1
    attn = _attention_group(rank, world, dp, timeout) if dp > 1 else None
    tp = TPGroup(rank=rank, size=world, ranks=ranks, device_group=device_group, cpu_group=cpu_group,
                 ep_size=config.ep_size, attn=attn, dp_size=dp, dp_rank=rank // (world // dp),
                 moe_a2a=config.moe_a2a_backend)
    state = ParallelState(world_rank=rank, world_size=world, local_rank=local_rank, device=device, tp=tp,
                          backend=backend, owns_world=True)
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm, group=device_group)
    if int(warm.item()) != world:
        state.destroy()
        raise DistInitError(f"rank {rank}: warm-up all-reduce gave {warm.item()} instead of {world}")
    return state
