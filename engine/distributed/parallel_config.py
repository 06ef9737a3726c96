"""`ParallelConfig`: the parallel layout flags (TP, DP attention, EP, nodes) and their checks.

Every check raises `UsageError` with a one-line message that says how to fix it, before any process
starts. Whether a TP size splits a model's weights cleanly is engine/distributed/divisibility.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from engine.errors import UsageError

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of one serving job (SGLang's flag names)."""

    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    moe_a2a_backend: str = "none"  # how MoE tokens reach their experts' ranks (engine/distributed/token_exchange.py)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None  # "HOST:PORT" of node 0's rendezvous, the same on every node
    base_gpu_id: int = 0
    dist_timeout: float = 600.0  # seconds: collectives and the rendezvous give up after this

    @property
    def world_size(self) -> int:
        """Processes in the torch.distributed world (one per GPU). DP attention and EP split the
        same TP world differently, so they do not add ranks."""
        return self.tp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        """World rank of this node's local rank `local_rank` (node 0 holds ranks 0..ranks_per_node-1)."""
        if not 0 <= local_rank < self.ranks_per_node:
            raise ValueError(f"local rank {local_rank} out of range for {self.ranks_per_node} ranks per node")
        return self.node_rank * self.ranks_per_node + local_rank

    def gpu_id(self, local_rank: int) -> int:
        return self.base_gpu_id + local_rank

    def host_port(self) -> tuple[str, int]:
        """(host, port) of --dist-init-addr (UsageError when absent or malformed)."""
        if self.dist_init_addr is None:
            raise UsageError("no --dist-init-addr: give HOST:PORT of node 0 (e.g. --dist-init-addr 10.0.0.1:5000)")
        return parse_host_port(self.dist_init_addr)

    def init_method(self) -> str:
        """The torch.distributed rendezvous URL, "tcp://HOST:PORT"."""
        host, port = self.host_port()
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def validate(self, device_type: str = "cpu", visible_gpus: Optional[int] = None) -> None:
        """Reject bad values and combinations; `visible_gpus` is this node's CUDA device count."""
        for flag, value in (("--tp-size", self.tp_size), ("--dp-size", self.dp_size),
                            ("--ep-size", self.ep_size), ("--nnodes", self.nnodes)):
            if value < 1:
                raise UsageError(f"{flag} must be >= 1 (got {value})")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes}): "
                             "number the nodes 0, 1, ... with node 0 serving HTTP")
        if self.base_gpu_id < 0:
            raise UsageError(f"--base-gpu-id must be >= 0 (got {self.base_gpu_id})")
        if not self.dist_timeout > 0:
            raise UsageError(f"--dist-timeout must be a positive number of seconds (got {self.dist_timeout})")
        if self.dist_init_addr is not None:
            parse_host_port(self.dist_init_addr)
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise UsageError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT: node 0's address, "
                             "the same on every node (e.g. --dist-init-addr 10.0.0.1:5000)")
        if self.world_size % self.nnodes:
            raise UsageError(f"--tp {self.tp_size} ranks cannot be spread evenly over --nnodes {self.nnodes}: "
                             f"use a TP size that is a multiple of {self.nnodes}")
        self._validate_dp_ep()
        if device_type == "cuda" and visible_gpus is not None:
            need = self.base_gpu_id + self.ranks_per_node
            if need > visible_gpus:
                raise UsageError(
                    f"--tp {self.tp_size} over --nnodes {self.nnodes} puts {self.ranks_per_node} ranks on this node "
                    f"(GPUs {self.base_gpu_id}..{need - 1}) but {visible_gpus} GPU(s) are visible: "
                    f"use --tp {max(1, visible_gpus - self.base_gpu_id) * self.nnodes} or more nodes (--nnodes)")

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one DP group's attention: tp / dp with DP attention, else tp."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    def _validate_dp_ep(self) -> None:
        if self.enable_dp_attention and self.tp_size == 1 and self.dp_size == 1:
            pass  # one rank: DP attention over one GPU is plain attention (check_launch says so)
        elif self.enable_dp_attention:
            if self.dp_size < 1 or self.dp_size > self.tp_size or self.tp_size % self.dp_size:
                raise UsageError(f"--enable-dp-attention needs --dp-size dividing --tp {self.tp_size} "
                                 f"(got --dp-size {self.dp_size}): e.g. --dp {self.tp_size}")
        elif self.dp_size > 1:
            raise UsageError(f"--dp-size {self.dp_size} splits attention into DP groups and needs "
                             "--enable-dp-attention (replicated whole engines are not supported: run one server "
                             "per group instead)")
        if self.ep_size > 1 and self.ep_size != self.tp_size:
            raise UsageError(f"--ep-size {self.ep_size} must equal --tp {self.tp_size}: every TP rank owns "
                             "n_routed_experts / tp whole experts (or use --enable-ep-moe)")
        if self.moe_a2a_backend != "none" and self.ep_size == 1:
            raise UsageError(f"--moe-a2a-backend {self.moe_a2a_backend} sends tokens to the ranks of their experts, "
                             "which needs expert parallelism: add --ep-size equal to --tp (at --tp 2 or more), or "
                             "drop it")


def parse_host_port(addr: str) -> tuple[str, int]:
    """"HOST:PORT" (or "[IPv6]:PORT") -> (host, port); UsageError with an example otherwise."""
    m = _HOST_PORT.match(addr.strip())
    port = int(m.group("port")) if m else 0
    if not m or not 0 < port < 65536:
        raise UsageError(f"--dist-init-addr {addr!r} is not HOST:PORT with a port in 1..65535 "
                         "(e.g. --dist-init-addr 10.0.0.1:5000)")
    return m.group("v6") or m.group("host"), port
