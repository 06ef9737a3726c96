"""Rank bodies of tests/test_custom_all_reduce.py's gloo world (4 ranks, and two 2-rank subgroups). Each rank
first runs the Triton kernels (interpreter) against the other rank processes through shared-memory buffers,
then runs both all-reduce algorithms over the real ranks with kernels/all_reduce_ref.py's chunk math and checks them
against torch.distributed's all_reduce, then checks that the op built for --all-reduce-backend custom
selects gloo on CPU and sums as gloo does; a mismatch raises and the supervisor names the rank."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from engine.distributed import custom_all_reduce as car
from engine.distributed.groups import TPGroup, init_parallel
from kernels import all_reduce_ref as ar

BLOCK = 16


def _input(group: TPGroup, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + group.rank)
    return (torch.randn(n, generator=g) * (1 + group.rank)).to(dtype)


def _two_shot(x: torch.Tensor, everyone: list[torch.Tensor], group: TPGroup) -> torch.Tensor:
    """Reduce-scatter (rank r sums chunk r of every input) and all-gather (the reduced chunks, padded to
    one length, gathered over gloo and put in place)."""
    world, n = group.size, x.numel()
    s, e = ar.chunk_bounds(n, world, BLOCK, group.rank)
    chunk = torch.zeros(ar.chunk_elems(n, world, BLOCK), dtype=x.dtype)
    chunk[:e - s] = ar.one_shot_reference([t[s:e] for t in everyone])[0]
    chunks = [torch.empty_like(chunk) for _ in range(world)]
    dist.all_gather(chunks, chunk, group=group.device_group)
    out = torch.empty_like(x)
    for q, c in enumerate(chunks):
        qs, qe = ar.chunk_bounds(n, world, BLOCK, q)
        out[qs:qe] = c[:qe - qs]
    return out


def _within_rounding(got: torch.Tensor, want: torch.Tensor, everyone: list[torch.Tensor]) -> None:
    """gloo sums bf16 step by step, rounding each partial sum: allow one rounding of the dtype per rank,
    relative to the sum of magnitudes."""
    bound = len(everyone) * torch.finfo(got.dtype).eps * torch.stack([t.double().abs() for t in everyone]).sum(0)
    diff = (got.double() - want.double()).abs()
    assert (diff <= bound).all(), f"{(diff - bound).max().item():.3g} over the rounding bound"


def _check_group(group: TPGroup, seed: int) -> None:
    for n, dtype in ((1000, torch.float32), (77, torch.bfloat16)):
        x = _input(group, n, dtype, seed)
        everyone = [torch.empty_like(x) for _ in range(group.size)]
        dist.all_gather(everyone, x, group=group.device_group)
        want = x.clone()
        dist.all_reduce(want, group=group.device_group)
        one, two = ar.one_shot_reference(everyone)[group.rank], _two_shot(x, everyone, group)
        assert torch.equal(one, two)  # the same sums, in the same order, put in the same places
        _within_rounding(one, want, everyone)
    op = car.AllReduceOp.open(group, torch.device("cpu"))
    assert op.selections[group.ranks].reason.startswith("gloo: ") and not op.groups
    y = _input(group, 50, torch.float32, seed)
    assert op.algorithm(y, group) == "gloo"
    want = y.clone()
    dist.all_reduce(want, group=group.device_group)
    assert op(y, group) is y and torch.equal(y, want)


# The kernels over real ranks: Triton's interpreter in every rank process, the peers' buffers and flags in
# shared memory (each process maps them at its own addresses, so each builds its own pointer tables).
PROGRAMS, KERNEL_BLOCK = 2, 64
CALLS = (("one_shot", 200, torch.float32), ("two_shot", 333, torch.bfloat16), ("two_shot", 64, torch.float32),
         ("one_shot", 131, torch.bfloat16))  # mixed, so the halves alternate and both flag arrays are used


def _kernel_calls(group: TPGroup, datas: list[torch.Tensor], flags: list[torch.Tensor]) -> None:
    from kernels import all_reduce  # lazy: Triton (~1 s) only for this check, not the gloo ones

    bufs = torch.tensor([d.data_ptr() for d in datas], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    counters = torch.zeros(PROGRAMS, dtype=torch.int64)
    half_bytes = datas[0].numel() // 2
    for i, (algorithm, n, dtype) in enumerate(CALLS):
        everyone = [(torch.randn(n, generator=torch.Generator().manual_seed(50 * i + r)) * (1 + r)).to(dtype)
                    for r in range(group.size)]
        x = everyone[group.rank].clone()
        launch = all_reduce.all_reduce_one_shot if algorithm == "one_shot" else all_reduce.all_reduce_two_shot
        launch(x, bufs, flag_ptrs, counters, group.rank, half_bytes // x.element_size(), block=KERNEL_BLOCK)
        assert torch.equal(x, ar.one_shot_reference(everyone)[0]), (algorithm, n, dtype)
    assert counters.tolist() == [len(CALLS)] * PROGRAMS


def gloo_ranks(local_rank: int, pc, shared: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
    """shared: every rank's (data, flags) buffers for the interpreted kernels (None: not interpreting)."""
    state = init_parallel(pc, local_rank, "cpu")
    if shared is not None:
        _kernel_calls(state.tp, *shared)
    _check_group(state.tp, seed=1)
    r = state.world_rank
    pairs = [(m, dist.new_group(list(m)), dist.new_group(list(m), backend="gloo")) for m in ((0, 1), (2, 3))]
    members, dev, cpu = pairs[r // 2]  # every rank created every group, in the same order
    _check_group(TPGroup(rank=r % 2, size=2, ranks=members, device_group=dev, cpu_group=cpu), seed=2 + r // 2)
    state.destroy()
