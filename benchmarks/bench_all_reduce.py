"""The custom all-reduce (engine/distributed/custom_all_reduce.py) against NCCL on the GPUs of one node:
correctness in and out of CUDA graphs, then time per call inside a CUDA graph, and the thresholds it implies.

    torchrun --nproc-per-node 2 benchmarks/bench_all_reduce.py [--check-only] [--max-mib 64]
             [--custom-max-mib 16] [--calls 20] [--replays 20] [--programs 64] [--block 1024] [--warps 4]
             [--result-file F.json]

One process per GPU (torchrun's env: NCCL world + a gloo group, the two groups the engine's TPGroup holds).
The custom group is set up as the engine does (P2P check, CUDA IPC), with a buffer of --custom-max-mib and the
launch shape of --programs / --block / --warps (the engine's `LaunchShape` by default).

Checks, bf16 messages of 1 KiB .. --max-mib (powers of 2), random per rank:
- one-shot and two-shot (up to the buffer size), eager and replayed from a CUDA graph (three replays with
  new inputs, an eager call between them: the device-side counters stay in step), and the op the engine
  calls (`AllReduceOp`, default thresholds: custom or NCCL by size), eager and in a graph;
- every rank's output is bit-identical to rank 0's, within one bf16 rounding of the exact (float64) sum,
  and equal to NCCL's within bf16 rounding (ranks x eps x the sum of magnitudes: NCCL rounds per step).
Any failure raises (the rank exits non-zero and torchrun reports it); rank 0 prints "all checks passed".

Timing (unless --check-only): per size, --calls in-place all-reduces captured in one CUDA graph, replayed
--replays times, CUDA events around the replays, microseconds per call (median of 3): NCCL, one-shot,
two-shot; and the same calls launched one by one without a graph (`calls` x `replays` of them between the events:
what an eager forward pays). The thresholds come from the graph timings. Rank 0 prints the table and the thresholds it measures for this GPU count, in
`DEFAULT_THRESHOLDS`' form: one-shot up to the largest size below which it is fastest throughout,
two-shot (or one-shot) up to the largest size below which the faster custom kernel beats NCCL throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.distributed.custom_all_reduce import (  # noqa: E402
    KIB,
    MIB,
    AllReduceOp,
    LaunchShape,
    Thresholds,
    describe,
    open_group,
)
from engine.distributed.groups import TPGroup  # noqa: E402

DTYPE = torch.bfloat16
ALGORITHMS = ("one_shot", "two_shot")


def setup() -> tuple[TPGroup, torch.device]:
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = TPGroup(rank=rank, size=world, ranks=tuple(range(world)), device_group=dist.group.WORLD,
                    cpu_group=dist.new_group(list(range(world)), backend="gloo"))
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # the NCCL communicator exists before any capture
    return group, device


def sizes(max_bytes: int) -> list[int]:
    out, b = [], KIB
    while b <= max_bytes:
        out.append(b)
        b *= 2
    return out


def message(nbytes: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    return torch.randn(nbytes // DTYPE.itemsize, generator=g, device=device).to(DTYPE)


class Oracle:
    """NCCL's sum, the exact float64 sum and the sum of magnitudes of every rank's x."""

    def __init__(self, x: torch.Tensor, group: TPGroup):
        self.nccl = x.clone()
        dist.all_reduce(self.nccl)
        self.exact = x.double()
        dist.all_reduce(self.exact)
        self.magnitude = x.double().abs()
        dist.all_reduce(self.magnitude)
        self.world = group.size

    def check(self, y: torch.Tensor, what: str, custom: bool = True) -> None:
        """Every rank holds the same y; a custom kernel's y is the float32 sum rounded once (one bf16 rounding
        of the exact sum, plus float32's own rounding where terms cancel); any y is within NCCL's rounding."""
        eps = torch.finfo(DTYPE).eps
        first = y.clone()
        dist.broadcast(first, src=0)
        if not torch.equal(first, y):
            raise AssertionError(f"{what}: ranks disagree ({(first != y).sum().item()} elements)")
        err = (y.double() - self.exact).abs()
        fp32 = self.world * torch.finfo(torch.float32).eps * self.magnitude
        if custom and not (err <= eps * self.exact.abs() + fp32).all():
            raise AssertionError(f"{what}: {err.max().item():.3g} from the exact sum")
        off = (y.double() - self.nccl.double()).abs()
        if not (off <= self.world * eps * self.magnitude + 1e-30).all():
            raise AssertionError(f"{what}: {off.max().item():.3g} from NCCL's sum")


def check_size(nbytes: int, group: TPGroup, device: torch.device, custom, op: AllReduceOp, seed: int) -> None:
    fits = nbytes <= custom.half_bytes
    runs = {algo: (lambda t, a=algo: custom.run(t, a)) for algo in ALGORITHMS if fits}
    runs["op"] = lambda t: op(t, group)
    for name, run in runs.items():
        x = message(nbytes, group.rank, seed, device)
        custom_ran = name != "op" or op.algorithm(x, group) != "nccl"
        oracle = Oracle(x, group)
        y = x.clone()
        run(y)
        oracle.check(y, f"{name} {nbytes} B eager", custom_ran)
        static = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(static)
        for replay in range(3):
            x = message(nbytes, group.rank, seed + 1 + replay, device)
            oracle = Oracle(x, group)
            static.copy_(x)
            graph.replay()
            oracle.check(static, f"{name} {nbytes} B graph replay {replay}", custom_ran)
            between = message(nbytes, group.rank, seed + 7 + replay, device)  # an eager call in between
            between_oracle = Oracle(between, group)
            run(between)
            between_oracle.check(between, f"{name} {nbytes} B eager after replay {replay}", custom_ran)
        graph.reset()


def _us_per_call(launch, calls: int) -> float:
    """Microseconds per call of `launch()`, which makes `calls` all-reduces: CUDA events around it, median of 3."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_graph(run, x: torch.Tensor, calls: int, replays: int) -> float:
    """Microseconds per call of `calls` in-place all-reduces captured in one graph, replayed `replays` times."""
    x.normal_(std=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run(x)
    graph.replay()
    torch.cuda.synchronize()
    us = _us_per_call(lambda: [graph.replay() for _ in range(replays)], replays * calls)
    graph.reset()
    return us


def time_eager(run, x: torch.Tensor, calls: int, replays: int) -> float:
    """Microseconds per call of `calls` x `replays` in-place all-reduces launched one by one from Python (no
    graph: each call pays its launch and the host work before it)."""
    x.normal_(std=1e-3)
    run(x)
    torch.cuda.synchronize()
    return _us_per_call(lambda: [run(x) for _ in range(replays * calls)], replays * calls)


def measured_thresholds(rows: list[dict]) -> Thresholds:
    """Custom up to the largest size below which the faster custom kernel beats NCCL at every size; one-shot
    up to the largest size (within that) below which one-shot is never slower than two-shot."""
    custom = one = 0
    for r in rows:  # ascending sizes
        if "one_shot" not in r or min(r["one_shot"], r["two_shot"]) >= r["nccl"]:
            break
        custom = r["bytes"]
    for r in rows:
        if r["bytes"] > custom or r["one_shot"] > r["two_shot"]:
            break
        one = r["bytes"]
    return Thresholds(one_shot_max=one, two_shot_max=custom)


def bench(group: TPGroup, custom, args) -> list[dict]:
    rows = []
    for nbytes in sizes(args.max_mib * MIB):
        x = torch.empty(nbytes // DTYPE.itemsize, dtype=DTYPE, device=custom.buffer.device)
        runs = {"nccl": lambda t: dist.all_reduce(t)}
        if nbytes <= custom.half_bytes:
            runs.update({algo: (lambda t, a=algo: custom.run(t, a)) for algo in ALGORITHMS})
        row = {"bytes": nbytes}
        for name, run in runs.items():
            row[name] = time_graph(run, x, args.calls, args.replays)
            row[f"{name}_eager"] = time_eager(run, x, args.calls, args.replays)
        rows.append(row)
    return rows


def table(rows: list[dict], world: int) -> str:
    names = ("nccl", "one_shot", "two_shot")
    lines = [f"all-reduce of bf16 messages over {world} GPUs, us per call: inside a CUDA graph | launched eagerly",
             f"{'bytes':>10} {'nccl':>9} {'one-shot':>9} {'two-shot':>9}  {'fastest':<9}|"
             f" {'nccl':>9} {'one-shot':>9} {'two-shot':>9}  fastest"]
    for r in rows:
        cells = []
        for suffix in ("", "_eager"):
            cells += [f"{r[k + suffix]:9.2f}" if k + suffix in r else f"{'-':>9}" for k in names]
            best = min((k for k in names if k + suffix in r), key=lambda k: r[k + suffix])
            cells.append(f" {best:<9}|" if not suffix else f" {best}")
        lines.append(f"{r['bytes']:>10} {' '.join(cells)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check-only", action="store_true", help="correctness only, no timing")
    p.add_argument("--max-mib", type=int, default=64, help="largest message (MiB)")
    p.add_argument("--custom-max-mib", type=int, default=16, help="the custom kernels' buffer half (MiB)")
    p.add_argument("--calls", type=int, default=20, help="all-reduces per captured graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    p.add_argument("--programs", type=int, default=LaunchShape.programs, help="custom kernels' grid")
    p.add_argument("--block", type=int, default=LaunchShape.block, help="custom kernels' tile (elements)")
    p.add_argument("--warps", type=int, default=LaunchShape.num_warps, help="custom kernels' warps per program")
    p.add_argument("--result-file", help="append the rows and thresholds as one JSON line (rank 0)")
    args = p.parse_args()
    t0 = time.perf_counter()
    group, device = setup()
    big = Thresholds(args.custom_max_mib * MIB, args.custom_max_mib * MIB)
    custom, sel = open_group(group, device, limits=big, max_bytes=args.custom_max_mib * MIB,
                             shape=LaunchShape(args.programs, args.block, args.warps))
    if custom is None:
        raise SystemExit(f"custom all-reduce unavailable here: {sel.reason}")
    op = AllReduceOp.open(group, device)
    for i, nbytes in enumerate(sizes(args.max_mib * MIB)):
        check_size(nbytes, group, device, custom, op, seed=10 * i)
    torch.cuda.synchronize()
    if group.rank == 0:
        print(f"all checks passed: {group.size} GPUs, {len(sizes(args.max_mib * MIB))} sizes 1 KiB .. "
              f"{args.max_mib} MiB, one-shot / two-shot / engine op ({describe(op.groups[group.ranks].limits)}), "
              f"eager and CUDA graphs ({time.perf_counter() - t0:.0f} s)", flush=True)
    if not args.check_only:
        rows = bench(group, custom, args)
        if group.rank == 0:
            found = measured_thresholds(rows)
            print(table(rows, group.size) + f"\n(custom: {custom.shape})")
            print(f"measured: {group.size}: Thresholds(one_shot_max={found.one_shot_max // KIB} * KIB, "
                  f"two_shot_max={found.two_shot_max // KIB} * KIB),  # {torch.cuda.get_device_name(device)}")
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(json.dumps({"world": group.size, "gpu": torch.cuda.get_device_name(device), "rows": rows,
                                        "programs": args.programs, "block": args.block, "warps": args.warps,
                                        "one_shot_max": found.one_shot_max, "two_shot_max": found.two_shot_max})
                            + "\n")
    dist.barrier(group=group.cpu_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
