"""Block-FP8 GEMM at decode sizes: the K loop whole, split automatically, and split 2 / 4 / 8, against the bytes floor.

    python benchmarks/bench_gemm_split_k.py --model deepseek-v3 --tp 1 [--model deepseek-v2 --tp 4] [--ms 1,4,16]
        [--moe deepseek-v2:4:1 --moe deepseek-v3:8:1] [--no-gemm]

Every block-FP8 linear of the model at that TP (for a bf16 checkpoint such as V2's, as
`--quantization fp8` serves it) (tuning/shapes.py), each M: the config the engine would take (the
tuned file, else the default) with SPLIT_K=1, with no SPLIT_K key (the automatic choice of
kernels/split_k.py split_k_for) and with SPLIT_K forced; cuBLASLt configs are skipped (M < 16 runs the Triton kernel).
Times are CUDA-graph replays over rotating weights (benchmarks/bench_moe_fp8.py graph_ms); the floor is the
weight, activation and output bytes over the copy bandwidth measured in the same run. Each split is checked
against the unsplit output first. Prints one table per model and TP; issue 35 (decode GEMMs at depth).
With --moe, the fused MoE (FP8 experts) the same way: floor = the bytes of the experts the routing touches.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import bench_moe_fp8 as bm  # noqa: E402
from kernels import tuned_configs as tc  # noqa: E402
from kernels.fp8 import block_fp8_matmul  # noqa: E402
from kernels.fp8_math import cdiv  # noqa: E402
from kernels.fused_moe import fused_moe  # noqa: E402
from kernels.split_k import split_k_for  # noqa: E402
from tuning.shapes import gemm_shapes, load_model_config, moe_shape  # noqa: E402

FORCED = (2, 4, 8)


def _row(head: str, times: dict[str, float], floor: float) -> str:
    """A table row: `head`, then the times unsplit, automatic and forced, the floor, the ratios, the best."""
    best = min(times, key=times.get)
    return (head + " | ".join(f"{times[s]:.1f}" for s in ["1", "auto"] + [str(f) for f in FORCED])
            + f" | {floor:.1f} | {times['1'] / floor:.2f}x | {times['auto'] / floor:.2f}x | "
            f"{best} ({times['1'] / times[best]:.2f}x) |")


def shape_rows(model: str, tp: int, ms: list[int], copy_gbps: float) -> list[str]:
    cfg = load_model_config(model)
    lines = []
    for shape in gemm_shapes(cfg, tp):
        n, k = shape.N, shape.K
        rot = max(1, min(bm.MOE_ROTATIONS, math.ceil(256e6 / (n * k))))
        ws = [bm.block_weights(n, k, seed=r) for r in range(rot)]
        for m in ms:
            a = torch.randn(m, k, device=bm.DEV, dtype=torch.bfloat16)
            base = {key: v for key, v in tc.get_fp8_gemm_config(n, k, m).items() if key not in ("CUBLAS", "SPLIT_K")}
            tiles = cdiv(m, base["BLOCK_SIZE_M"]) * cdiv(n, base["BLOCK_SIZE_N"])
            auto = split_k_for(tiles, cdiv(k, 128), torch.device(bm.DEV), base)
            whole = block_fp8_matmul(a, ws[0][0], ws[0][1], config=dict(base, SPLIT_K=1)).float()
            times = {}
            for label, c in [("1", dict(base, SPLIT_K=1)), ("auto", base)] + [(str(s), dict(base, SPLIT_K=s))
                                                                             for s in FORCED]:
                got = block_fp8_matmul(a, ws[0][0], ws[0][1], config=c).float()
                err = ((got - whole).abs().max() / whole.abs().max().clamp_min(1e-30)).item()
                if err > 1e-2:
                    bm.FAILURES.append(f"{model} tp{tp} {n}x{k} M={m} split {label}: rel err {err:.2e}")
                times[label] = bm.graph_ms([lambda i=i, c=c: block_fp8_matmul(a, ws[i][0], ws[i][1], config=c)
                                            for i in range(rot)]) * 1e3
            floor = (n * k + n * cdiv(k, 128) * 4 // 128 + m * k * 2 + m * n * 2) / (copy_gbps * 1e3)
            lines.append(_row(f"| {model} tp{tp} | {'+'.join(shape.layers)} | {n}x{k} | {m} | {tiles} | {auto} | ",
                              times, floor))
            print(lines[-1], flush=True)
        ws = None
        torch.cuda.empty_cache()
    return lines


def moe_rows(model: str, tp: int, ep: int, ms: list[int], copy_gbps: float) -> list[str]:
    """The fused MoE (FP8) of the model at this TP / EP: the tuned config with SPLIT_K=1, without the key
    (automatic) and forced, against the bytes of the experts the routing touches."""
    shape = moe_shape(load_model_config(model), tp=tp, ep=ep, dtype="fp8_w8a8")
    e, n, k, top_k = shape.E, shape.N, shape.K, shape.top_k
    g = torch.Generator(device=bm.DEV).manual_seed(0)
    w13, w2 = bm._rand_fp8((e, 2 * n, k), g), bm._rand_fp8((e, k, n), g)
    s13 = torch.rand(e, cdiv(2 * n, 128), cdiv(k, 128), device=bm.DEV, generator=g) * 1e-4
    s2 = torch.rand(e, cdiv(k, 128), cdiv(n, 128), device=bm.DEV, generator=g) * 1e-4
    lines = []
    for m in ms:
        x = torch.randn(m, k, device=bm.DEV, dtype=torch.bfloat16, generator=g)
        ids = [torch.stack([torch.randperm(e, device=bm.DEV, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
               for _ in range(bm.MOE_ROTATIONS)]
        w = torch.rand(m, top_k, device=bm.DEV, generator=g)
        base = {key: v for key, v in tc.get_moe_config(e, n, m, top_k, "fp8_w8a8").items() if key != "SPLIT_K"}
        touched = sum(len(set(i.flatten().tolist())) for i in ids) / len(ids)
        floor = touched * 3 * n * k / (copy_gbps * 1e3)
        times = {}
        for label, c in [("1", dict(base, SPLIT_K=1)), ("auto", base)] + [(str(f), dict(base, SPLIT_K=f))
                                                                         for f in FORCED]:
            times[label] = bm.graph_ms([lambda i=i, c=c: fused_moe(x, w13, w2, ids[i], w, w13_scale=s13,
                                                                   w2_scale=s2, config=c)
                                        for i in range(len(ids))]) * 1e3
        lines.append(_row(f"| {model} tp{tp} ep{ep} | fused MoE E={e} N={n} | {m} | ", times, floor))
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="registry model (repeat; pairs with --tp in order)")
    p.add_argument("--tp", action="append", type=int)
    p.add_argument("--ms", default="1,2,4,8,16", help="comma list of M (rows)")
    p.add_argument("--moe", action="append", default=[], help="also the fused MoE of MODEL:TP:EP (repeat)")
    p.add_argument("--no-gemm", action="store_true", help="the --moe rows only")
    args = p.parse_args()
    models = args.model or ["deepseek-v3"]
    tps = args.tp or [1] * len(models)
    if len(tps) != len(models):
        p.error("give one --tp per --model")
    bm.LOG = open("/dev/null", "w")
    ceil = bm.ceilings()
    print(f"copy bandwidth {ceil['copy_gbps']:.0f} GB/s on {torch.cuda.get_device_name()}")
    header = ("| model | layers | N x K | M | tiles | auto split | us split 1 | auto | "
              + " | ".join(f"split {s}" for s in FORCED) + " | floor us | 1 x floor | auto x floor | best |")
    ms = [int(x) for x in args.ms.split(",")]
    lines = []
    for model, tp in zip(models, tps) if not args.no_gemm else []:
        lines += shape_rows(model, tp, ms, ceil["copy_gbps"])
    moe = [r for spec in args.moe for r in moe_rows(spec.split(":")[0], *map(int, spec.split(":")[1:]), ms,
                                                   ceil["copy_gbps"])]
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(lines))
    if moe:
        head = ("| model | kernel | M | us split 1 | auto | " + " | ".join(f"split {s}" for s in FORCED)
                + " | floor us | 1 x floor | auto x floor | best |")
        print("\n" + head + "\n|" + "---|" * (head.count("|") - 1) + "\n" + "\n".join(moe))
    if bm.FAILURES:
        print("FAILURES:\n" + "\n".join(bm.FAILURES))
        sys.exit(1)


if __name__ == "__main__":
    main()
