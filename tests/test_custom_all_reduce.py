"""The custom all-reduce (engine/distributed/custom_all_reduce.py, kernels/all_reduce.py) on CPU.

- the algorithm choice by size and group size, and the selection's fallbacks (gloo, group size, nodes, P2P);
- the two-shot chunk math and both references against the rank-order float32 sum;
- the Triton kernels under the interpreter, peers simulated as tensors of this process: each rank's launch
  is run with its peers' buffers and flags in the state the peers leave them in at that point (inputs
  staged, two-shot's reduced chunks, flags raised), so its own staging, signals, reduction, gather and
  counters are checked against the reference;
- 4 gloo ranks (and two 2-rank subgroups): the real kernels, run concurrently by the 4 rank processes under
  the interpreter over buffers and flags in shared memory (a sequence of one-shot and two-shot calls: the
  flags, counters and alternating halves across processes), equal to the rank-order sum; both algorithms,
  run over real ranks with the same chunk math, equal torch.distributed's all_reduce; the op built for
  --all-reduce-backend custom says gloo on CPU and gives gloo's sums.
Greedy tokens of the tiny model at TP 2 with --all-reduce-backend custom (gloo underneath on CPU) are
tests/distributed/test_engine_tp.py's first case.
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed import custom_all_reduce as car
from engine.distributed.parallel_config import ParallelConfig
from engine.runtime.launch import free_port, start_ranks
from kernels import all_reduce as ark
from kernels import all_reduce_ref as ar
from kernels.interpret import interpreting
from tests import custom_all_reduce_targets

KIB = 1024
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the simulated-peer kernel runs on one GPU too


def _inputs(world: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * (1 + r)).to(dtype) for r in range(world)]


def _exact(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The rank-order float32 sum rounded once, which every rank of both kernels computes; checked against
    the float64 sum to within one rounding of the dtype."""
    acc = torch.zeros(inputs[0].shape, dtype=torch.float32)
    for x in inputs:
        acc = acc + x.float()
    out = acc.to(inputs[0].dtype)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    eps = torch.finfo(out.dtype).eps
    assert ((out.double() - exact).abs() <= eps * exact.abs() + 1e-6).all()
    return out


def test_algorithm_by_size_and_group():
    t = car.Thresholds(one_shot_max=64 * KIB, two_shot_max=1024 * KIB)
    assert [car.pick_algorithm(b, t) for b in (1, 64 * KIB, 64 * KIB + 1, 1024 * KIB, 1024 * KIB + 1)] == \
        ["one_shot", "one_shot", "two_shot", "two_shot", "nccl"]
    two = car.DEFAULT_THRESHOLDS[2]
    assert car.pick_algorithm(two.one_shot_max + 2, two) == "nccl"  # no two-shot at 2 ranks
    assert set(car.DEFAULT_THRESHOLDS) == set(car.SUPPORTED_WORLDS)
    assert all(t.one_shot_max <= t.two_shot_max for t in car.DEFAULT_THRESHOLDS.values())


def test_tensors_the_kernels_cannot_take_go_to_nccl():
    t = car.Thresholds(one_shot_max=4 * KIB, two_shot_max=64 * KIB)
    x = torch.randn(8, 256, dtype=torch.bfloat16)  # 4 KiB
    assert car.tensor_algorithm(x, t, capacity=64 * KIB) == "one_shot"
    assert car.tensor_algorithm(torch.randn(8, 1024, dtype=torch.bfloat16), t, capacity=64 * KIB) == "two_shot"
    assert car.tensor_algorithm(x.t(), t, capacity=64 * KIB) == "nccl"  # strided
    assert car.tensor_algorithm(x.to(torch.int32), t, capacity=64 * KIB) == "nccl"
    assert car.tensor_algorithm(torch.randn(8, 1024, dtype=torch.bfloat16), t, capacity=8 * KIB) == "nccl"


@pytest.mark.parametrize("args, custom, words", [
    (("gloo", 2, True, True), False, "gloo: the custom all-reduce needs CUDA"),
    (("nccl", 3, True, True), False, "not 3"),
    (("nccl", 4, False, True), False, "several nodes"),
    (("nccl", 4, True, False), False, "no P2P"),
    (("nccl", 8, True, True), True, "custom"),
])
def test_selection_and_its_fallbacks(args, custom, words):
    sel = car.select(*args)
    assert sel.custom is custom and words in sel.reason


@pytest.mark.parametrize("n", [1, 7, 1000, 4096, 4097, 12345])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_chunks_tile_the_tensor(n, world):
    block = 64
    bounds = [ar.chunk_bounds(n, world, block, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # disjoint, in rank order, no gap
    assert all(s % block == 0 for s, _ in bounds if s < n)  # every chunk starts on a whole tile
    assert ar.chunk_elems(n, world, block) * world - n < world * block  # padding under a tile per rank


@pytest.mark.parametrize("world, n, dtype", [(2, 1000, torch.bfloat16), (4, 4097, torch.float16),
                                             (8, 333, torch.float32), (4, 3, torch.bfloat16)])
def test_references_equal_the_sum(world, n, dtype):
    xs = _inputs(world, n, dtype, seed=world)
    want = _exact(xs)
    for outs in (ar.one_shot_reference(xs), ar.two_shot_reference(xs, block=64)):
        assert len(outs) == world and all(torch.equal(o, want) for o in outs)


def _simulate(algorithm: str, xs: list[torch.Tensor], rank: int, programs: int, block: int, call: int):
    """Run `rank`'s kernel with its peers' buffers as they leave them before its barriers; returns its
    output, every rank's flags and data, and the counters."""
    world, n, dtype = len(xs), xs[0].numel(), xs[0].dtype
    half = (2 * n + 63) // 64 * 64  # elements per data half, a multiple of 16 as the kernels require
    h = (call % 2) * half
    flags = [torch.zeros(ar.flag_slots(programs), dtype=torch.int64, device=DEVICE) for _ in range(world)]
    datas = [torch.full((2 * half,), float("nan"), dtype=dtype, device=DEVICE) for _ in range(world)]
    reduced = _exact(xs).to(DEVICE)
    for p in range(world):
        if p == rank:
            continue
        datas[p][h:h + n] = xs[p].to(DEVICE)
        s, e = ar.chunk_bounds(n, world, block, p)
        if algorithm == "two_shot":
            datas[p][h + s:h + e] = reduced[s:e]
        for slot in range(2 * programs):
            flags[rank][slot * ar.MAX_RANKS + p] = call + 1 + (p % 2)  # a peer may already be a call ahead
    counters = torch.full((programs,), call, dtype=torch.int64, device=DEVICE)
    bufs = torch.tensor([d.data_ptr() for d in datas], dtype=torch.int64, device=DEVICE)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=DEVICE)
    x = xs[rank].to(DEVICE, copy=True)
    launch = ark.all_reduce_one_shot if algorithm == "one_shot" else ark.all_reduce_two_shot
    out = launch(x, bufs, flag_ptrs, counters, rank, half, block=block)
    cpu = [t.cpu() for t in (x, counters)]
    return out is x, *cpu, [f.cpu() for f in flags], [d.cpu() for d in datas], h


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world, n, dtype, call", [(2, 200, torch.bfloat16, 0), (4, 333, torch.bfloat16, 7),
                                                   (4, 130, torch.float32, 2)])
def test_kernels_with_simulated_peers(algorithm, world, n, dtype, call):
    programs, block = 3, 32
    xs = _inputs(world, n, dtype, seed=n)
    want = _exact(xs)
    for rank in range(world):
        in_place, x, counters, flags, datas, h = _simulate(algorithm, xs, rank, programs, block, call)
        assert in_place and torch.equal(x, want), (rank, (x.float() - want.float()).abs().max())
        assert counters.tolist() == [call + 1] * programs
        phases = 2 if algorithm == "two_shot" else 1
        for p in range(world):  # its flag raised in every rank's slot, per program and barrier
            words = flags[p].view(2, programs, ar.MAX_RANKS)[:phases, :, rank]
            assert (words == call + 1).all(), (rank, p, words)
        own = datas[rank][h:h + n]
        if algorithm == "one_shot":
            assert torch.equal(own, xs[rank])  # staged into the half of this call
        else:
            s, e = ar.chunk_bounds(n, world, block, rank)
            assert torch.equal(own[s:e], want[s:e])  # its reduced chunk, for the peers' all-gather
            assert torch.equal(torch.cat([own[:s], own[e:]]), torch.cat([xs[rank][:s], xs[rank][e:]]))
        half = datas[rank].numel() // 2
        other = datas[rank][half:] if h == 0 else datas[rank][:half]
        assert other.isnan().all()  # the other half (the previous call's) untouched


# ---- real gloo ranks (tests/custom_all_reduce_targets.py) -------------------------------------------

def test_algorithms_over_gloo_ranks_equal_torch_distributed():
    pc = ParallelConfig(tp_size=4, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=60)
    half = 2048  # bytes per data half
    datas = [torch.zeros(2 * half, dtype=torch.uint8).share_memory_() for _ in range(4)]
    flags = [torch.zeros(ar.flag_slots(custom_all_reduce_targets.PROGRAMS), dtype=torch.int64).share_memory_()
             for _ in range(4)]
    shared = (datas, flags) if interpreting() else None  # on a GPU machine the GPU tests run the kernels
    sup = start_ranks(custom_all_reduce_targets.gloo_ranks, 4, (pc, shared))
    try:
        failure = sup.wait(timeout=120)
    finally:
        sup.stop()
    assert failure is None, failure.message() + "\n" + failure.details
