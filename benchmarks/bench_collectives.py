"""All-reduce and all-gather time at DeepSeek-V3's hidden size, against the link's measured bus bandwidth.

    python3 benchmarks/bench_collectives.py [--tp 2] [--hidden 7168] [--tokens 1,2,4,...,4096]
                                            [--device cuda|cpu] [--result-file F.jsonl]

One process per rank (engine.runtime.ranks.EngineRanks, as every launcher starts ranks, + init_parallel:
NCCL on CUDA, gloo on CPU, the groups the engine uses), timing the engine's own collectives (engine/distributed/comm.py):
`all_reduce` of a [T, hidden] bf16 tensor (the o_proj / MLP / MoE sums) and `all_gather_rows` of a
[T, hidden] tensor per rank (DP attention's gather before every MLP), for each token count T.

- eager: the median over --iters calls of one collective, CUDA events around each (on CPU, wall clock);
- graph (CUDA only): --graph-calls calls captured in one CUDA graph, replayed, time / calls; decode
  steps replay graphs, so this is the cost a decode step pays per collective.

The link's bus bandwidth is measured first in the same run: a --peak-mib (1 GiB) all-reduce and all-gather; bus
bandwidth follows NCCL's convention (all-reduce: 2 (n-1)/n x bytes / t; all-gather: (n-1)/n x the
gathered bytes / t). Each row's bus bandwidth is then shown as a fraction of that peak: small
messages are latency-bound, large ones should approach it. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.distributed.parallel_config import ParallelConfig  # noqa: E402
from engine.runtime.launch import with_local_init_addr  # noqa: E402
from engine.runtime.ranks import EngineRankError, EngineRanks  # noqa: E402

EXIT_S = 60.0  # how long the ranks get to leave the world once rank 0 sent its figures
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def bus_factor(op: str, n: int) -> float:
    """NCCL's bus-bandwidth factor: what each link carries relative to the message (algorithm) bytes."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _timer(device):
    """A function timing `fn` once: CUDA events on a GPU, wall clock on CPU (seconds)."""
    import torch

    if device.type != "cuda":
        def wall(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return wall

    def events(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return events


def _ops(tp):
    from engine.distributed import comm

    return {"all_reduce": lambda x: comm.all_reduce(x, tp), "all_gather": lambda x: comm.all_gather_rows(x, tp)}


def _message_bytes(op: str, x, n: int) -> int:
    """The algorithm bytes of one call: the reduced tensor, or the gathered [n T, hidden] output."""
    return x.numel() * x.element_size() * (n if op == "all_gather" else 1)


def _eager_s(fn, x, iters: int, timer, barrier) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(iters):
        barrier()  # every rank starts the call together: the time is the collective's, not a straggler's
        times.append(timer(lambda: fn(x)))
    return statistics.median(times)


def _graph_s(fn, x, calls: int, replays: int, timer) -> float:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(timer(graph.replay) for _ in range(replays)) / calls


def rank_main(local_rank: int, pc: ParallelConfig, opts: dict, inbox, outbox) -> None:
    import torch

    from engine.distributed.comm import barrier
    from engine.distributed.groups import init_parallel

    state = init_parallel(pc, local_rank, opts["device"])
    tp, n, device = state.tp, state.world_size, state.device
    first = state.world_rank == 0
    timer, sync = _timer(device), (lambda: barrier(tp))
    rows = []
    try:
        ops = _ops(tp)
        for op, fn in ops.items():  # the link's peak first
            x = torch.randn(opts["peak_mib"] * 2**20 // 2 // (n if op == "all_gather" else 1), dtype=torch.bfloat16, device=device)
            t = _eager_s(fn, x, max(3, opts["iters"] // 10), timer, sync)
            nbytes = _message_bytes(op, x, n)
            rows.append({"op": op, "tokens": None, "bytes": nbytes, "eager_s": t,
                         "bus_gbps": bus_factor(op, n) * nbytes / t / 1e9})
            del x
        for op, fn in ops.items():
            for t_count in opts["tokens"]:
                x = torch.randn(t_count, opts["hidden"], dtype=torch.bfloat16, device=device)
                nbytes = _message_bytes(op, x, n)
                row = {"op": op, "tokens": t_count, "bytes": nbytes,
                       "eager_s": _eager_s(fn, x, opts["iters"], timer, sync)}
                if device.type == "cuda":
                    row["graph_s"] = _graph_s(fn, x, opts["graph_calls"], 10, timer)
                best = min(row["eager_s"], row.get("graph_s", float("inf")))
                row["bus_gbps"] = bus_factor(op, n) * nbytes / best / 1e9
                rows.append(row)
        if first:
            outbox.send({"ranks": n, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "rows": rows})
    finally:
        if not first:
            inbox.close()
            outbox.close()
        state.destroy()


def print_table(run: dict, hidden: int) -> None:
    rows = run["rows"]
    peak = {r["op"]: r["bus_gbps"] for r in rows if r["tokens"] is None}
    print(f"\nCollectives over {run['ranks']} ranks ({run['device']}), bf16 [T, {hidden}] per rank; "
          "time per call in us (eager: median of single calls; graph: replayed inside a CUDA graph)")
    print("link peak (largest message): " + ", ".join(f"{op} {bw:.0f} GB/s bus" for op, bw in peak.items()))
    print(f"{'op':<10} {'T':>5} {'MiB':>8} {'eager us':>9} {'graph us':>9} {'bus GB/s':>9} {'of peak':>8}")
    for r in rows:
        if r["tokens"] is None:
            continue
        graph = f"{r['graph_s'] * 1e6:9.1f}" if "graph_s" in r else f"{'-':>9}"
        print(f"{r['op']:<10} {r['tokens']:>5} {r['bytes'] / 2**20:8.3f} {r['eager_s'] * 1e6:9.1f} {graph} "
              f"{r['bus_gbps']:9.1f} {r['bus_gbps'] / peak[r['op']]:8.0%}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--peak-mib", type=int, default=1024, help="message size of the link-peak measurement")
    p.add_argument("--result-file", default=None)
    a = p.parse_args(argv)
    opts = {"device": a.device, "hidden": a.hidden, "tokens": [int(t) for t in a.tokens.split(",")],
            "iters": a.iters, "graph_calls": a.graph_calls, "peak_mib": a.peak_mib}
    pc = with_local_init_addr(ParallelConfig(tp_size=a.tp))
    ranks = EngineRanks.start(rank_main, pc, pc, opts)
    try:
        run = ranks.receive()
        ranks.finish(EXIT_S)
    except EngineRankError as exc:
        raise SystemExit(f"bench_collectives: {exc}") from None
    finally:
        ranks.stop()
    print_table(run, a.hidden)
    if a.result_file:
        with open(a.result_file, "a") as f:
            for r in run["rows"]:
                f.write(json.dumps({"ranks": run["ranks"], "device": run["device"], "hidden": a.hidden, **r}) + "\n")
    return run


if __name__ == "__main__":
    main()
