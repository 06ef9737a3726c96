"""Check and time the W4AFP8 fused MoE (INT4 experts, FP8 activations) against its bytes floor and the FP8 kernel.

    python benchmarks/bench_w4afp8_moe.py [--shapes tp4,tp8,ep8] [--batches 1,4,16,64,128,256,4096]
        [--configs sweep|quick|FILE.json|'[{...}, ...]'] [--quick] [--out DIR]

Shapes: DeepSeek-V3's routed experts (hidden 7168, moe_intermediate 2048, top-8 of 256 by the V3 router,
noaux_tc, on random logits) as one rank holds them: tp4 (E 256, N 512), tp8 (E 256, N 256), ep8 (E 32 whole
experts, N 2048; the ids of the other ranks' experts contribute nothing). Per shape and batch:

1. the torch reference (kernels/fused_moe_w4a8.py `fused_moe_w4a8_ref`) once; then every variant (a launch
   config; see `SWEEP`) is run once and checked against it (relative error < 1e-2: bf16 intermediates) before
   it is timed. A variant that fails the check or does not compile is reported (FAIL / ERR) and skipped;
2. the variants' times, the FP8 kernel's (kernels/fused_moe.py, block-FP8 weights, the config the engine
   would use) and the bytes floor: (packed INT4 weights + group scales of the experts the routing touches
   + x read + out written) / HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s; other GPUs: a measured copy).

`engine` is what the engine runs today (config=None: the tuned file for this GPU, else
kernels/tuned_configs.py's default). Variant names: m<BLOCK_M>n<BLOCK_N>w<warps>s<stages>; `-mma` forces the
row-major kernel (SWAP_AB 0; the swapped one runs tiles of 64+ weight rows otherwise), `-k<N>` the swapped
kernel's K step (whole INT4 groups), `-sT` the same config with the weight scales stored K-group-major (a layout
the loader could adopt: the kernel reads strides), `-d<N>` the down GEMM's BLOCK_N. Times are medians
(triton.testing.do_bench) of a CUDA graph that runs the op over 8 rotating routings (2 for T > 256), divided by
the count. About 2 minutes on one H200.
Writes DIR/results.md and DIR/results.json with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
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

E_ROUTER, HIDDEN, INTER, TOP_K = 256, 7168, 2048, 8
SHAPES = {"tp4": (256, 512), "tp8": (256, 256), "ep8": (32, 2048)}  # name -> (experts on the rank, N)
BATCHES = [1, 4, 16, 64, 128, 256, 4096]
DEV = "cuda"
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # spec bandwidth by GPU name
TOLERANCE = 1e-2


def cfg(bm, bn, bk=128, gm=1, w=4, s=4, **extra):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=s,
                **extra)


# (name, config, scales K-group-major). Tiles of 64+ weight rows (BLOCK_N) run the swapped kernel (wgmma: weights x
# tokens, FP8 dots) by default; `-mma` forces the row-major kernel (SWAP_AB 0: float16 mma.sync below 64 rows,
# FP8 wgmma from 64), as do tiles of 32 weight rows; `-tilesums` has the swapped kernel sum each loaded tile of A
# itself (ACT_SUMS 0) instead of reading the group sums its quantiser wrote (the default). The tuner's row cap per batch (tuning/search_space.py)
# drops tiles too tall for the batch.
SWEEP = [
    ("m16n32w2s8-mma", cfg(16, 32, w=2, s=8, BLOCK_SIZE_N_DOWN=128, num_stages_DOWN=4, SWAP_AB_DOWN=0), False),
    ("m16n64w4s4-mma", cfg(16, 64, w=4, s=4, BLOCK_SIZE_N_DOWN=128, SWAP_AB=0), False),
    ("m16n64w4s4", cfg(16, 64, w=4, s=4, BLOCK_SIZE_N_DOWN=128), False),
    ("m16n64w4s3-k256", cfg(16, 64, bk=256, w=4, s=3, BLOCK_SIZE_N_DOWN=128), False),
    ("m16n64w4s3-k256-sT", cfg(16, 64, bk=256, w=4, s=3, BLOCK_SIZE_N_DOWN=128), True),
    ("m16n64w4s3-k256-tilesums", cfg(16, 64, bk=256, w=4, s=3, BLOCK_SIZE_N_DOWN=128, ACT_SUMS=0, ACT_SUMS_DOWN=0),
     False),
    ("m16n64w4s2-k512", cfg(16, 64, bk=512, w=4, s=2, BLOCK_SIZE_N_DOWN=128), False),
    ("m16n128w4s3", cfg(16, 128, w=4, s=3, BLOCK_SIZE_N_DOWN=128), False),
    ("m16n64w4s4-d256w8", cfg(16, 64, w=4, s=4, BLOCK_SIZE_N_DOWN=256, num_warps_DOWN=8), False),
    ("m32n64w4s4-mma", cfg(32, 64, w=4, s=4, BLOCK_SIZE_N_DOWN=128, SWAP_AB=0), False),
    ("m32n128w4s3", cfg(32, 128, w=4, s=3), False),
    ("m64n128w8s3-mma", cfg(64, 128, gm=16, w=8, s=3, SWAP_AB=0), False),
    ("m64n128w8s3", cfg(64, 128, gm=16, w=8, s=3), False),
]
QUICK = ["m16n32w2s8-mma", "m16n64w4s4-mma", "m16n64w4s3-k256", "m32n128w4s3", "m64n128w8s3"]


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


def int4_weights(e: int, n: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.randint(-128, 128, (e, 2 * n, HIDDEN // 2), device=DEV, generator=g, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (e, HIDDEN, n // 2), device=DEV, generator=g, dtype=torch.int8)
    s13 = torch.rand(e, 2 * n, HIDDEN // INT4_GROUP, device=DEV, generator=g) * 2e-3 + 1e-3
    s2 = torch.rand(e, HIDDEN, n // min(INT4_GROUP, n), device=DEV, generator=g) * 2e-3 + 1e-3
    return w13, w2, s13, s2


def group_major(s: torch.Tensor) -> torch.Tensor:
    """The same scales [E, rows, groups] stored as [E, groups, rows] (a strided view of it)."""
    return s.transpose(1, 2).contiguous().transpose(1, 2)


def fp8_weights(e: int, n: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = torch.empty(e, 2 * n, HIDDEN, dtype=FP8_DTYPE, device=DEV)
    w2 = torch.empty(e, HIDDEN, n, dtype=FP8_DTYPE, device=DEV)
    for i in range(e):
        w13[i] = torch.randn(2 * n, HIDDEN, device=DEV, generator=g).to(FP8_DTYPE)
        w2[i] = torch.randn(HIDDEN, n, device=DEV, generator=g).to(FP8_DTYPE)
    s13 = torch.rand(e, -(-2 * n // 128), -(-HIDDEN // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
    s2 = torch.rand(e, -(-HIDDEN // 128), -(-n // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
    return w13, w2, s13, s2


def expert_bytes(ws, e: int) -> float:
    """Bytes of one expert: its weights and scales, in every tensor of `ws` (stacked over E)."""
    return sum(t.numel() * t.element_size() for t in ws) / e


def rel(a, b) -> float:
    """|a - b| / |b|; 0 when both are zero (an EP rank whose experts no token chose: nothing to compare)."""
    a, b = a.double(), b.double()
    diff = (a - b).norm()
    return 0.0 if diff == 0 else (diff / b.norm()).item()


def graph_check(e: int, n: int) -> bool:
    """The engine's config: eager against the reference and the exact INT4 product; CUDA-graph replay == eager."""
    t = 37
    w13, w2, s13, s2 = int4_weights(e, n, seed=1)
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
    ok = torch.isfinite(got).all().item() and e_ref < TOLERANCE and e_exact < 0.1 and torch.equal(out, got)
    log(f"## engine config, E={e} N={n} T={t}: vs reference {e_ref:.2e} (limit {TOLERANCE}), vs exact INT4 "
        f"product {e_exact:.2e} (limit 0.1), graph == eager {torch.equal(out, got)}: {'ok' if ok else 'FAIL'}")
    return bool(ok)


def variants(t: int, selection: list) -> list:
    """(name, config or None, scales K-group-major) to run at batch t: the engine's choice, then the selection
    within the tuner's row cap for t."""
    cap = moe_rows_cap(t, TOP_K, E_ROUTER)
    return [("engine", None, False)] + [v for v in selection if v[1]["BLOCK_SIZE_M"] <= cap]


def bench_batch(t, e, n, w4, w4_t, fp8, selection, bw, rows_by_variant):
    """One (shape, batch): check and time every variant; the FP8 kernel; returns the row of the summary."""
    rot = 8 if t <= 256 else 2
    sets = [routing(t, seed=1000 * t + r) for r in range(rot)]
    xs = [torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16) for _ in range(rot)]
    touched = statistics.mean(int(ids[ids < e].unique().numel()) for ids, _ in sets)
    act = 2 * t * HIDDEN * 2  # x read, out written (bf16)
    floor = (touched * expert_bytes(w4, e) + act) / bw * 1e6
    floor_fp8 = (touched * expert_bytes(fp8, e) + act) / bw * 1e6
    ref = fused_moe_w4a8_ref(xs[0], *w4[:2], *sets[0], w13_scale=w4[2], w2_scale=w4[3])

    def calls(fn, ws, c):
        return [lambda i=i: fn(xs[i], ws[0], ws[1], sets[i][0], sets[i][1], w13_scale=ws[2], w2_scale=ws[3],
                               config=c) for i in range(rot)]

    timed = {}
    for name, c, scale_t in variants(t, selection):
        ws = w4_t if scale_t else w4
        try:
            err = rel(fused_moe_w4a8(xs[0], ws[0], ws[1], *sets[0], w13_scale=ws[2], w2_scale=ws[3], config=c), ref)
            if not err < TOLERANCE:  # NaN fails too
                rows_by_variant.setdefault(name, {})[t] = f"FAIL {err:.0e}"
                log(f"    {name}: FAIL, relative error {err:.2e} against the reference (limit {TOLERANCE})")
                continue
            timed[name] = graph_ms(calls(fused_moe_w4a8, ws, c)) * 1e3
            rows_by_variant.setdefault(name, {})[t] = f"{timed[name]:.1f} ({100 * floor / timed[name]:.0f}%)"
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, the sweep goes on
            rows_by_variant.setdefault(name, {})[t] = "ERR"
            log(f"    {name}: ERR {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            traceback.print_exc(limit=2)
            torch.cuda.synchronize()
    try:
        fp8_us = graph_ms(calls(fused_moe, fp8, None)) * 1e3
    except Exception as exc:  # noqa: BLE001 - the comparison is lost for this batch, not the run
        log(f"    FP8 kernel: ERR {type(exc).__name__}: {str(exc)[:300]}")
        fp8_us = float("nan")
    best = min(timed, key=timed.get) if timed else None
    row = dict(batch=t, experts=touched, floor_us=floor, fp8_us=fp8_us, fp8_floor_us=floor_fp8,
               engine_us=timed.get("engine"), best=best, best_us=timed.get(best),
               engine_config=tc.get_moe_config(e, n, t, TOP_K, DTYPE_NAME), times=timed)
    rows_by_variant.setdefault("FP8 kernel", {})[t] = f"{fp8_us:.1f} ({100 * floor_fp8 / fp8_us:.0f}%)"
    rows_by_variant.setdefault("W4 floor", {})[t] = f"{floor:.1f}"
    if best:
        log(f"  T={t:5d} experts={touched:6.1f} floor={floor:7.1f}us engine={timed.get('engine', float('nan')):7.1f}us "
            f"best={best} {timed[best]:7.1f}us ({100 * floor / timed[best]:3.0f}% of floor) | FP8 {fp8_us:7.1f}us "
            f"-> best W4 {fp8_us / timed[best]:.2f}x faster")
    else:
        log(f"  T={t:5d}: every variant failed | FP8 {fp8_us:7.1f}us")
    return row


def bench_shape(shape: str, batches, selection, bw: float) -> tuple[list, dict]:
    e, n = SHAPES[shape]
    log(f"\n## {shape}: E={e} K={HIDDEN} N={n} top-{TOP_K} of {E_ROUTER}")
    w4 = int4_weights(e, n, seed=3)
    w4_t = (w4[0], w4[1], group_major(w4[2]), group_major(w4[3])) if any(v[2] for v in selection) else w4
    fp8 = fp8_weights(e, n, seed=4)
    rows, by_variant = [], {"W4 floor": {}, "FP8 kernel": {}}  # first in the table
    for t in batches:
        rows.append(dict(shape=shape, **bench_batch(t, e, n, w4, w4_t, fp8, selection, bw, by_variant)))
    del w4, w4_t, fp8
    torch.cuda.empty_cache()
    return rows, by_variant


def variant_table(shape: str, batches, by_variant: dict) -> str:
    """Rows: variants; columns: batches; cells: us (% of the bytes floor), FAIL / ERR, blank where not run."""
    out = [f"### {shape}: us per call (% of bytes floor)", "",
           "| variant | " + " | ".join(f"T={t}" for t in batches) + " |", "| --- |" + " ---: |" * len(batches)]
    for name, cells in by_variant.items():
        out.append(f"| {name} | " + " | ".join(cells.get(t, "") for t in batches) + " |")
    return "\n".join(out)


def _num(v, fmt: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def summary(rows, source: str) -> str:
    out = [f"W4AFP8 fused MoE, {source}", "",
           "| shape | batch | experts | W4 floor us | engine us | best us | best variant | best % of floor | "
           "FP8 us | FP8 / best | FP8 / engine |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | "
           "---: | ---: |"]
    for r in rows:
        eng, best = r["engine_us"], r["best_us"]
        pct = None if best is None else 100 * r["floor_us"] / best
        out.append(f"| {r['shape']} | {r['batch']} | {r['experts']:.1f} | {r['floor_us']:.1f} | "
                   f"{_num(eng, none='FAIL')} | {_num(best)} | {r['best'] or '-'} | {_num(pct, '.0f')}% | "
                   f"{r['fp8_us']:.1f} | {_num(best and r['fp8_us'] / best, '.2f')}x | "
                   f"{_num(eng and r['fp8_us'] / eng, '.2f')}x |")
    return "\n".join(out)


def advice(rows) -> str:
    """Where a variant beat the engine's config by more than 5%: the config to make the default there."""
    lines = []
    for r in rows:
        if r["best"] and r["engine_us"] and r["best"] != "engine" and r["best_us"] < 0.95 * r["engine_us"]:
            lines.append(f"- {r['shape']} T={r['batch']}: {r['best']} is {r['engine_us'] / r['best_us']:.2f}x the "
                         f"engine's config ({json.dumps(r['engine_config'])})")
    head = "Variants beating the engine's config by > 5% (candidates for kernels/tuned_configs.py's w4afp8 default):"
    return head + ("\n" + "\n".join(lines) if lines else " none")


def selection_from(spec: str) -> list:
    """--configs: 'sweep' (SWEEP), 'quick' (QUICK), or a JSON list of configs (inline or a file path)."""
    if spec == "sweep":
        return SWEEP
    if spec == "quick":
        return [v for v in SWEEP if v[0] in QUICK]
    raw = json.loads(spec if spec.lstrip().startswith("[") else Path(spec).read_text())
    return [(c.pop("name", f"cfg{i}"), c, bool(c.pop("SCALES_GROUP_MAJOR", 0))) for i, c in enumerate(raw)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--configs", default="sweep", help="sweep | quick | JSON list of configs (or a file holding one)"
                   "; a config may carry 'name' and SCALES_GROUP_MAJOR=1")
    p.add_argument("--quick", action="store_true", help="the same as --configs quick")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 2
    start = time.time()
    bw, source = bandwidth()
    selection = selection_from("quick" if args.quick else args.configs)
    batches = [int(b) for b in args.batches.split(",")]
    log(f"# {source}; variants: {', '.join(v[0] for v in selection)}")
    ok = all(graph_check(*SHAPES[s]) for s in ("tp8", "ep8"))
    rows, tables = [], []
    for shape in args.shapes.split(","):
        shape_rows, by_variant = bench_shape(shape, batches, selection, bw)
        rows += shape_rows
        tables.append(variant_table(shape, batches, by_variant))
    md = "\n\n".join([summary(rows, source), *tables, advice(rows)])
    log("\n" + md + f"\n\n{time.time() - start:.0f} s; engine-config checks {'ok' if ok else 'FAILED'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(md + "\n")
        (args.out / "results.json").write_text(json.dumps({"device": source, "check_ok": ok, "rows": rows},
                                                          indent=1, default=str))
    wrong = any("FAIL" in t for t in tables)  # a wrong result is a kernel bug; ERR (cannot run) is only reported
    return 0 if ok and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
