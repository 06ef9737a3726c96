"""The custom all-reduce for small messages between the GPUs of one node (--all-reduce-backend custom).

NCCL runs a decode step's all-reduces of a few KB at 10-30 us each inside a CUDA graph; reading the peers'
data straight from their memory over NVLink takes a few. `AllReduceOp` is the `Kernels.all_reduce` of
this backend: per call it picks, by message size and group size (`pick_algorithm`, from a measured
`Thresholds` table), kernels/all_reduce.py's one-shot or two-shot kernel or NCCL (engine/distributed/comm.py,
which stays for large messages, across nodes and on CPU).

Set-up (`AllReduceOp.open`, a collective over every group's gloo cpu_group, run at kernel build time on
every rank in the same order): `select` decides whether a group can use it at all (CUDA, 2/4/6/8 ranks
on one host, every GPU reaching every other through P2P, `torch.cuda.can_device_access_peer`); if every
rank agrees, each allocates one buffer (`CustomAllReduce`: flags + two data halves) with torch and shares
it through CUDA IPC. Sharing goes through `torch.multiprocessing.reductions.reduce_tensor` /
`rebuild_cuda_tensor`, the route torch itself uses to pass CUDA tensors between processes: it handles the
caching allocator's block offsets, opens the handle with peer access enabled and keeps the producer's
memory alive while it is mapped, with no ctypes binding of a particular libcudart. Its pickled handle
crosses the group with `all_gather_object`. NVLink multicast is never used.

CUDA graphs: the kernels stage their input into the IPC buffer themselves and keep their call counters in
device memory, so a captured call needs no registered graph buffers and replays stay in step across
ranks; like NCCL, every rank must run the same all-reduces in the same order. The buffers live as long as
the process (their peers' mappings too).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from engine.distributed import comm
from engine.distributed.groups import TPGroup
from kernels.all_reduce_ref import SUPPORTED_DTYPES, flag_slots

log = logging.getLogger(__name__)

SUPPORTED_WORLDS = (2, 4, 6, 8)
KIB, MIB = 1 << 10, 1 << 20
ALIGN = 256  # bytes: start of every region of a buffer
PROGRAMS = 64  # programs per launch (fixed: their counters advance together)
BLOCK = 1024  # elements per tile
NUM_WARPS = 4


@dataclass(frozen=True)
class LaunchShape:
    """The kernels' launch: a fixed grid (every program's counter advances on every call), tile, warps."""

    programs: int = PROGRAMS
    block: int = BLOCK
    num_warps: int = NUM_WARPS


@dataclass(frozen=True)
class Thresholds:
    """Message sizes (bytes, inclusive) up to which each algorithm runs; NCCL above `two_shot_max`."""

    one_shot_max: int
    two_shot_max: int


# H100 / H200 NVLink: benchmarks/bench_all_reduce.py measures these and prints a table in this form. 2 GPUs: measured
# on H100 (2026-11-27); 4-8 GPUs: first guesses, not measured yet.
DEFAULT_THRESHOLDS: dict[int, Thresholds] = {
    2: Thresholds(one_shot_max=2 * MIB, two_shot_max=2 * MIB),  # 2 x H100 (docs/perf.md); two-shot never wins
    4: Thresholds(one_shot_max=512 * KIB, two_shot_max=512 * KIB),  # 4 x H200 (docs/perf.md); two-shot never wins
    6: Thresholds(one_shot_max=128 * KIB, two_shot_max=4 * MIB),
    8: Thresholds(one_shot_max=128 * KIB, two_shot_max=4 * MIB),
}


def pick_algorithm(nbytes: int, limits: Thresholds) -> str:
    """'one_shot', 'two_shot' or 'nccl' for a message of `nbytes`."""
    if nbytes <= limits.one_shot_max:
        return "one_shot"
    return "two_shot" if nbytes <= limits.two_shot_max else "nccl"


def tensor_algorithm(x: torch.Tensor, limits: Thresholds, capacity: int) -> str:
    """`pick_algorithm` for x, or 'nccl' where the kernels cannot take it: strided, another dtype, or more
    than `capacity` bytes (a buffer half)."""
    nbytes = x.numel() * x.element_size()
    if not x.is_contiguous() or x.dtype not in SUPPORTED_DTYPES or nbytes > capacity:
        return "nccl"
    return pick_algorithm(nbytes, limits)


@dataclass(frozen=True)
class Selection:
    """Whether a group runs the custom all-reduce, and the start-up log's words for it."""

    custom: bool
    reason: str


def select(backend: str, world: int, one_host: bool, peers_ok: bool) -> Selection:
    """The custom kernels need NCCL's setting (CUDA), a supported group size, one host and P2P everywhere."""
    if backend != "nccl":
        return Selection(False, f"{backend}: the custom all-reduce needs CUDA GPUs")
    if world not in SUPPORTED_WORLDS:
        return Selection(False, f"nccl: the custom all-reduce runs on {SUPPORTED_WORLDS} GPUs, not {world}")
    if not one_host:
        return Selection(False, "nccl: the group spans several nodes")
    if not peers_ok:
        return Selection(False, "nccl: these GPUs cannot all reach each other's memory (no P2P)")
    return Selection(True, "custom")


def describe(limits: Thresholds) -> str:
    """'custom one-shot <= 256 KiB, two-shot <= 4096 KiB, nccl above'."""
    two = f", two-shot <= {limits.two_shot_max // KIB} KiB" if limits.two_shot_max > limits.one_shot_max else ""
    return f"custom one-shot <= {limits.one_shot_max // KIB} KiB{two}, nccl above"


def _gather(obj, group: TPGroup) -> list:
    out = [None] * group.size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def _peers_reachable(device: torch.device, devices: list[int]) -> bool:
    others = [d for d in devices if d != device.index]
    return len(set(devices)) == len(devices) and all(torch.cuda.can_device_access_peer(device, d) for d in others)


class CustomAllReduce:
    """One group's peer buffers (this rank's and the mapped peers'), counters and thresholds.

    Every rank's buffer: `flag_slots(shape.programs)` int64 flags, then two halves of `half_bytes` bytes. Made
    by `open` (a collective) only for a group `select` accepted."""

    def __init__(self, group: TPGroup, device: torch.device, limits: Thresholds, max_bytes: int,
                 shape: LaunchShape = LaunchShape()):
        self.rank, self.world, self.limits, self.shape = group.rank, group.size, limits, shape
        self.half_bytes = _round_up(max_bytes, ALIGN)
        flag_bytes = _round_up(flag_slots(shape.programs) * 8, ALIGN)
        self.buffer = torch.zeros(flag_bytes + 2 * self.half_bytes, dtype=torch.uint8, device=device)
        self.counters = torch.zeros(shape.programs, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)  # zeroed before any peer can signal into it
        self.peers: list[torch.Tensor] = []
        self.buf_ptrs = self.flag_ptrs = None
        from kernels import all_reduce  # lazy: Triton, for CUDA groups only (the CPU path never builds one)

        # under torch.compile a graph break (dynamo loads here, not at import); CUDA graphs capture the launch
        self.launch = {name: torch.compiler.disable(fn) for name, fn in
                       (("one_shot", all_reduce.all_reduce_one_shot), ("two_shot", all_reduce.all_reduce_two_shot))}

    def map_peers(self, handles: list) -> None:
        """Open every peer's buffer from its `reduce_tensor` handle (rank order)."""
        bases = []
        for r, (rebuild, args) in enumerate(handles):
            # Open the handle on OUR device (the 7th argument of rebuild_cuda_tensor is the device to open it
            # on): cudaIpcOpenMemHandle then maps the peer's memory into this device's context with peer access
            # enabled, so our kernels can read it. Opened on the owner's device index, the mapping would live in
            # a second CUDA context on that GPU (memory wasted) that our kernels may not access.
            args = (*args[:6], self.buffer.device.index, *args[7:])
            t = self.buffer if r == self.rank else rebuild(*args)
            if r != self.rank:
                self.peers.append(t)
            bases.append(t.data_ptr())
        flag_bytes = self.buffer.numel() - 2 * self.half_bytes
        dev = self.buffer.device
        self.flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=dev)
        self.buf_ptrs = torch.tensor([b + flag_bytes for b in bases], dtype=torch.int64, device=dev)

    def algorithm(self, x: torch.Tensor) -> str:
        """What runs for x: 'one_shot', 'two_shot' or 'nccl'."""
        return tensor_algorithm(x, self.limits, self.half_bytes)

    def run(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        """Sum x over the group in place with `algorithm` ('one_shot' | 'two_shot')."""
        return self.launch[algorithm](x, self.buf_ptrs, self.flag_ptrs, self.counters, self.rank,
                                      self.half_bytes // x.element_size(), block=self.shape.block,
                                      num_warps=self.shape.num_warps)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _attempt(fn, arg) -> tuple[object, str]:
    """(fn(arg), '') or (None, the error's first line): a rank's failure must reach the others, not hang them."""
    try:
        return fn(arg), ""
    except RuntimeError as exc:  # CUDA IPC refused (expandable segments, containers without IPC, ...)
        text = str(exc).strip()
        return None, text.splitlines()[0] if text else type(exc).__name__


def open_group(group: TPGroup, device: torch.device, limits: Optional[Thresholds] = None,
               max_bytes: Optional[int] = None, shape: LaunchShape = LaunchShape(),
               ) -> tuple[Optional[CustomAllReduce], Selection]:
    """The group's custom all-reduce (None where `select` or the IPC set-up says no), and why. A collective:
    every rank of the group calls it at the same point."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend != "nccl" or group.size not in SUPPORTED_WORLDS:
        return None, select(backend, group.size, True, False)
    places = _gather((socket.gethostname(), device.index), group)
    one_host = len({host for host, _ in places}) == 1
    reachable = one_host and _peers_reachable(device, [d for _, d in places])
    choice = select(backend, group.size, one_host, all(_gather(reachable, group)))
    if not choice.custom:
        return None, choice
    limits = limits or DEFAULT_THRESHOLDS[group.size]
    ar = CustomAllReduce(group, device, limits, max_bytes or max(limits.two_shot_max, limits.one_shot_max), shape)
    shared = _gather(_attempt(reduce_tensor, ar.buffer), group)  # (handle, error) per rank
    failures = [err for _, err in shared if err]
    if not failures:  # every rank opens every peer's buffer, or none uses them
        failures = [err for _, err in _gather(_attempt(ar.map_peers, [h for h, _ in shared]), group) if err]
    if failures:
        return None, Selection(False, f"nccl: CUDA IPC set-up failed: {failures[0]}")
    torch.cuda.synchronize(device)
    dist.barrier(group=group.cpu_group)
    return ar, Selection(True, describe(limits))


class AllReduceOp:
    """`Kernels.all_reduce` for --all-reduce-backend custom: each group's custom all-reduce where it has
    one and the message fits its thresholds, else comm.all_reduce (NCCL, or gloo on CPU)."""

    def __init__(self, groups: dict[tuple[int, ...], CustomAllReduce], selections: dict[tuple[int, ...], Selection]):
        self.groups = groups
        self.selections = selections  # per group (its world ranks): what runs, or why not the custom kernels

    @classmethod
    def open(cls, group: Optional[TPGroup], device: torch.device) -> "AllReduceOp":
        """Set up the model's group and its DP-attention group (a collective on every rank)."""
        groups, selections = {}, {}
        for g in _groups(group):
            ar, choice = open_group(g, device)
            selections[g.ranks] = choice
            if ar is not None:
                groups[g.ranks] = ar
            log.info("all-reduce over ranks %s: %s", list(g.ranks), choice.reason)
        return cls(groups, selections)

    def algorithm(self, x: torch.Tensor, group: TPGroup) -> str:
        """'one_shot', 'two_shot', or 'nccl' / 'gloo' (comm.all_reduce) for x over `group`."""
        ar = self.groups.get(group.ranks) if group.size > 1 else None
        if ar is None:
            return "nccl" if x.is_cuda else "gloo"
        return ar.algorithm(x) if x.device == ar.buffer.device else "nccl"

    def __call__(self, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        algorithm = self.algorithm(x, group)
        if algorithm in ("one_shot", "two_shot"):
            return self.groups[group.ranks].run(x, algorithm)
        return comm.all_reduce(x, group)


def _groups(group: Optional[TPGroup]) -> list[TPGroup]:
    """The groups a model all-reduces over: its group, and with DP attention the attention group."""
    if group is None:
        return []
    found = [g for g in (group, group.attn) if g is not None and g.size > 1]
    return [g for i, g in enumerate(found) if g.ranks not in {f.ranks for f in found[:i]}]
