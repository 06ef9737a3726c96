"""Check and time the W4AFP8 fused MoE (INT4 experts, FP8 activations) at DeepSeek-V3 shapes on one CUDA GPU.

    python benchmarks/bench_w4afp8_moe.py [--tp 4,8] [--batches 1,2,...,512] [--quick] [--out DIR]

E = 256 routed experts, hidden 7168, moe_intermediate 2048 split over --tp (N = 512 at TP 4, 256 at TP 8),
top-8 by the V3 router (noaux_tc) on random logits, batch 1..512:

1. check (once, TP 8, T = 37): kernels/fused_moe_w4a8.py against its torch reference (same roundings:
   relative error ~1e-3 from the bf16 intermediate) and against the exact INT4-weight product (FP8
   activation rounding, a few %); CUDA-graph replay == eager.
2. per TP and batch: the W4AFP8 kernel (the built-in default config, the tuned file's config when one
   exists for this GPU, and unless --quick a small sweep) against its bytes floor and against the FP8
   kernel (kernels/fused_moe.py, block-FP8 weights, its default / tuned config) at the same shapes.
   Floor = (packed weights + group scales of the experts the routing touches + x read + out written)
   / the GPU's HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s; other GPUs: the measured copy rate).

Times are medians (triton.testing.do_bench) of a CUDA graph that runs the op over 8 rotating routings,
divided by 8 (decode replays graphs; rotation keeps the touched experts out of L2). About 2 minutes on one
H100 (under 1 minute with --quick). Writes DIR/results.md and DIR/results.json when --out is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from benchmarks.bench_moe_fp8 import graph_ms, routing  # noqa: E402  (the same V3 router, E and top-k)
from kernels import tuned_configs as tc  # noqa: E402
from kernels.fp8_math import FP8_DTYPE  # noqa: E402
from kernels.fused_moe import fused_moe  # noqa: E402
from kernels.fused_moe_w4a8 import DTYPE_NAME, fused_moe_w4a8, fused_moe_w4a8_ref  # noqa: E402
from kernels.int4 import INT4_GROUP  # noqa: E402
from tuning.search_space import moe_rows_cap  # noqa: E402

E, HIDDEN, INTER, TOP_K = 256, 7168, 2048, 8
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ROTATIONS = 8
DEV = "cuda"
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # spec bandwidth by GPU name


def cfg(bm, bn, bk, gm=1, w=4, s=3, **extra):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=s,
                **extra)


SWEEP = [cfg(16, 32, 128, s=4, BLOCK_SIZE_N_DOWN=64), cfg(16, 64, 128, s=4), cfg(16, 64, 64, s=5),
         cfg(16, 128, 128, s=3), cfg(32, 64, 128, s=4), cfg(32, 128, 128, s=3), cfg(64, 64, 128, s=4),
         cfg(64, 128, 128, gm=16, s=3), cfg(64, 128, 128, gm=16, w=8, s=4)]


def log(*args):
    print(" ".join(str(a) for a in args), flush=True)


def bandwidth() -> tuple[float, str]:
    """(bytes/s, where from): the spec HBM rate of an H100 / H200, else a measured device copy."""
    name = torch.cuda.get_device_name()
    for key, tbps in HBM_TBPS.items():
        if key in name:
            return tbps * 1e12, f"{name}: {tbps} TB/s (spec)"
    src = torch.empty(1 << 28, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() * 4 / ms * 1e3, f"{name}: measured copy"


def graph_us(fns) -> float:
    """Median us of one call, in a CUDA graph that runs fns in turn (bench_moe_fp8's timing)."""
    return graph_ms(fns) * 1e3


def int4_weights(n: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randint(-128, 128, (E, 2 * n, HIDDEN // 2), device=DEV, generator=g, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (E, HIDDEN, n // 2), device=DEV, generator=g, dtype=torch.int8)
    s13 = torch.rand(E, 2 * n, HIDDEN // INT4_GROUP, device=DEV, generator=g) * 2e-3 + 1e-3
    s2 = torch.rand(E, HIDDEN, n // min(INT4_GROUP, n), device=DEV, generator=g) * 2e-3 + 1e-3
    return w13, w2, s13, s2


def fp8_weights(n: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.empty(E, 2 * n, HIDDEN, dtype=FP8_DTYPE, device=DEV)
    w2 = torch.empty(E, HIDDEN, n, dtype=FP8_DTYPE, device=DEV)
    for e in range(E):
        w13[e] = torch.randn(2 * n, HIDDEN, device=DEV, generator=g).to(FP8_DTYPE)
        w2[e] = torch.randn(HIDDEN, n, device=DEV, generator=g).to(FP8_DTYPE)
    s13 = torch.rand(E, -(-2 * n // 128), -(-HIDDEN // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
    s2 = torch.rand(E, -(-HIDDEN // 128), -(-n // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
    return w13, w2, s13, s2


def expert_bytes(ws) -> float:
    """Bytes of one expert: its weights and scales, in every tensor of `ws` (stacked over E)."""
    return sum(t.numel() * t.element_size() for t in ws) / E


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check() -> bool:
    n, t = INTER // 8, 37
    w13, w2, s13, s2 = int4_weights(n, seed=1)
    x = torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16)
    ids, w = routing(t, seed=2)
    got = fused_moe_w4a8(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_w4a8_ref(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2)
    exact = fused_moe_w4a8_ref(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2, quantize=False,
                               compute_dtype=torch.float64)
    out = torch.empty_like(got)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe_w4a8(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2, out=out)
    g.replay()
    torch.cuda.synchronize()
    e_ref, e_exact = rel(got, ref), rel(got, exact)
    ok = torch.isfinite(got).all().item() and e_ref < 1e-2 and e_exact < 0.1 and torch.equal(out, got)
    log(f"## check (TP 8, T={t}): vs reference {e_ref:.2e} (limit 1e-2), vs exact INT4 product {e_exact:.2e} "
        f"(limit 0.1), graph == eager {torch.equal(out, got)}: {'ok' if ok else 'FAIL'}")
    return bool(ok)


def candidates(t: int, n: int, quick: bool) -> list[dict]:
    default = tc.default_moe_config(t, E, n, TOP_K, DTYPE_NAME)
    tuned = tc.get_moe_config(E, n, t, TOP_K, DTYPE_NAME)
    out = [default] + ([tuned] if tuned != default else [])
    if not quick:
        cap = moe_rows_cap(t, TOP_K, E)  # the tuner's limit on BLOCK_SIZE_M for this batch
        out += [c for c in SWEEP if c["BLOCK_SIZE_M"] <= cap and c not in out]
    return out


def bench_tp(tp: int, batches, bw: float, quick: bool) -> list[dict]:
    n = INTER // tp
    log(f"\n## TP {tp}: E={E} K={HIDDEN} N={n} top-{TOP_K}")
    w4 = int4_weights(n, seed=3)
    fp8 = fp8_weights(n, seed=4)
    w4_bytes, fp8_bytes = expert_bytes(w4), expert_bytes(fp8)
    rows = []
    for t in batches:
        sets = [routing(t, seed=1000 * t + r) for r in range(ROTATIONS)]
        xs = [torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16) for _ in range(ROTATIONS)]
        touched = statistics.mean(int(ids.unique().numel()) for ids, _ in sets)
        act = 2 * t * HIDDEN * 2  # x read, out written (bf16)
        floor = (touched * w4_bytes + act) / bw * 1e6
        floor_fp8 = (touched * fp8_bytes + act) / bw * 1e6

        def run(fn, ws, c):
            return [lambda i=i: fn(xs[i], ws[0], ws[1], sets[i][0], sets[i][1], w13_scale=ws[2], w2_scale=ws[3],
                                   config=c) for i in range(ROTATIONS)]

        timed = []
        for c in candidates(t, n, quick):
            try:
                timed.append((graph_us(run(fused_moe_w4a8, w4, c)), c))
            except Exception as exc:  # noqa: BLE001 - a config that cannot launch is skipped, and said
                log(f"    config {c} failed: {type(exc).__name__}: {str(exc)[:200]}")
        best_us, best = min(timed, key=lambda r: r[0])
        fp8_us = graph_us(run(fused_moe, fp8, tc.get_moe_config(E, n, t, TOP_K, "fp8_w8a8")))
        row = dict(tp=tp, batch=t, experts=touched, floor_us=floor, default_us=timed[0][0], best_us=best_us,
                   pct_floor=100 * floor / best_us, fp8_us=fp8_us, fp8_floor_us=floor_fp8,
                   speedup_vs_fp8=fp8_us / best_us, best_config=best)
        rows.append(row)
        log(f"  T={t:4d} experts={touched:6.1f} floor={floor:7.1f}us default={timed[0][0]:7.1f}us "
            f"best={best_us:7.1f}us ({row['pct_floor']:5.1f}% of floor) | fp8={fp8_us:7.1f}us "
            f"(floor {floor_fp8:7.1f}us) w4/fp8 speed-up {row['speedup_vs_fp8']:.2f}x  {json.dumps(best)}")
    return rows


def table(rows, source: str) -> str:
    out = [f"W4AFP8 fused MoE, {source}", "",
           "| TP | batch | experts | floor us | W4 default us | W4 best us | % of floor | FP8 us | FP8 floor us |"
           " W4 speed-up |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['tp']} | {r['batch']} | {r['experts']:.1f} | {r['floor_us']:.1f} | {r['default_us']:.1f} | "
                   f"{r['best_us']:.1f} | {r['pct_floor']:.0f}% | {r['fp8_us']:.1f} | {r['fp8_floor_us']:.1f} | "
                   f"{r['speedup_vs_fp8']:.2f}x |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="4,8")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--quick", action="store_true", help="time only the default and tuned configs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 2
    start = time.time()
    bw, source = bandwidth()
    log(f"# {source}; triton configs: tuned file if present, else defaults")
    ok = check()
    rows = []
    for tp in map(int, args.tp.split(",")):
        rows += bench_tp(tp, [int(b) for b in args.batches.split(",")], bw, args.quick)
        torch.cuda.empty_cache()
    md = table(rows, source)
    log("\n" + md + f"\n\n{time.time() - start:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(md + "\n")
        (args.out / "results.json").write_text(json.dumps({"device": source, "check_ok": ok, "rows": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
