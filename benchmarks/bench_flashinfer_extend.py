"""MLA's expanded prefill ("extend") attention: dsctl's Triton kernel next to FlashInfer's batch prefill (fa2, fa3).

    python benchmarks/bench_flashinfer_extend.py [--heads 128,16] [--configs] [--out DIR]

The problem is the one the engine's Triton backend hands to `extend_attention`: per head, q and k of
192 values (128 nope + 64 rope), v of 128, new tokens causal among themselves and fully over a cached
prefix. FlashInfer sees each request's keys as one ragged row block [prefix; new] (causal masks align
to the end of the keys), as `BatchPrefillWithRaggedKVCacheWrapper` takes them; building that
concatenation is not timed. Every kernel's output is checked against Triton's (and against
`extend_attention_ref` where the reference's score tensor fits), then timed as one CUDA-graph replay
(median, L2 flushed). TFLOP/s counts the causal FLOPs once: 2 x heads x visible pairs x (192 + 128).
--configs also times a few other Triton launch configs (the fastest is reported beside the default).
Then the host cost of FlashInfer's plan() per extend forward. Prints the table last; writes
bench_flashinfer_extend.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mla import DEV, NOPE, ROPE, SM_SCALE, VDIM, ExtendCase, bench_graph, rel_err  # noqa: E402

from kernels.mla_extend import ExtendConfig, extend_attention_ref  # noqa: E402
from kernels.mla_extend import default_config as extend_default_config  # noqa: E402

FI_BACKENDS = ("fa2", "fa3")
SHAPES = [  # (batch, new tokens per request, prefix per request)
    (1, 256, 0), (1, 512, 0), (8, 256, 0), (1, 1024, 0), (1, 4096, 0), (1, 16384, 0), (4, 4096, 0), (16, 1024, 0),
    (1, 2048, 8192), (4, 1024, 3072),
]
TRITON_VARIANTS = [ExtendConfig(bm, bn, w, s) for bm, bn, w, s in
                   [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 3),
                    (128, 64, 4, 3)]]
REF_MAX_SCORES = 1 << 28  # float32 scores the reference may hold at once (1 GiB)


def ragged_kv(case: ExtendCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys / values as one block [prefix; new] (the layout FlashInfer's ragged prefill reads)."""
    b, e, p = case.batch, case.ext, case.pre
    k = case.k.view(b, e, case.heads, -1)
    v = case.v.view(b, e, case.heads, -1)
    if p:
        k = torch.cat((case.kp.view(b, p, case.heads, -1), k), 1)
        v = torch.cat((case.vp.view(b, p, case.heads, -1), v), 1)
    return k.reshape(b * (p + e), case.heads, -1).contiguous(), v.reshape(b * (p + e), case.heads, -1).contiguous()


def flashinfer_fn(case: ExtendCase, backend: str, workspace: torch.Tensor, out: torch.Tensor):
    """Plan FlashInfer's ragged prefill for the case; return (run closure, host ms of plan())."""
    from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

    k, v = ragged_kv(case)
    i32 = dict(dtype=torch.int32, device=DEV)
    qo_indptr = torch.arange(case.batch + 1, **i32) * case.ext
    kv_indptr = torch.arange(case.batch + 1, **i32) * (case.ext + case.pre)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
    torch.cuda.synchronize()
    t = time.perf_counter()
    wrapper.plan(qo_indptr, kv_indptr, case.heads, case.heads, NOPE + ROPE, head_dim_vo=VDIM, causal=True,
                 sm_scale=SM_SCALE, q_data_type=case.q.dtype, kv_data_type=k.dtype)
    plan_ms = (time.perf_counter() - t) * 1e3
    return (lambda: wrapper.run(case.q, k, v, out=out)), plan_ms


def run_shape(heads: int, shape: tuple, workspace: torch.Tensor, variants: list[ExtendConfig]) -> dict:
    batch, ext, pre = shape
    case = ExtendCase(heads, batch, ext, pre, seed=heads + ext + pre)
    row = {"heads": heads, "batch": batch, "ext": ext, "pre": pre}
    flops = case.flops()
    out_t = torch.empty(case.q.shape[0], heads, VDIM, device=DEV, dtype=torch.bfloat16)
    default = extend_default_config(NOPE + ROPE, VDIM, torch.device(DEV))
    case.fn(default, out_t)()
    if heads * ext * (ext + pre) <= REF_MAX_SCORES:
        row["triton_err_ref"] = rel_err(out_t, extend_attention_ref(case.q, case.k, case.v, case.kp, case.vp,
                                                                    case.el, case.pl, SM_SCALE))
    ms = bench_graph(case.fn(default, torch.empty_like(out_t)))
    row.update(triton_us=ms * 1e3, triton_tflops=flops / ms / 1e9, triton_cfg=asdict(default))
    best = (ms, default)
    for cfg in variants:
        try:
            t = bench_graph(case.fn(cfg, torch.empty_like(out_t)))
        except Exception as exc:  # a config that does not fit this GPU's shared memory
            print(f"  {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            continue
        if t < best[0]:
            best = (t, cfg)
    row.update(best_us=best[0] * 1e3, best_cfg=asdict(best[1]))
    for backend in FI_BACKENDS:
        out = torch.full_like(out_t, float("nan"))
        try:
            fn, plan_ms = flashinfer_fn(case, backend, workspace, out)
            fn()
            torch.cuda.synchronize()
            row[f"{backend}_err_triton"] = rel_err(out, out_t) if not out.isnan().any() else float("nan")
            t = bench_graph(fn)
            row.update({f"{backend}_us": t * 1e3, f"{backend}_tflops": flops / t / 1e9, f"{backend}_plan_ms": plan_ms})
        except Exception as exc:  # an unsupported (backend, shape) must not hide the other cases
            row[f"{backend}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del case
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--configs", action="store_true", help="also time TRITON_VARIANTS")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    opts = ap.parse_args()
    import flashinfer

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__}
    print(json.dumps(info), flush=True)
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    rows = []
    for heads in map(int, opts.heads.split(",")):
        for shape in SHAPES:
            rows.append(run_shape(heads, shape, workspace, TRITON_VARIANTS if opts.configs else []))
            print(json.dumps(rows[-1]), flush=True)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "bench_flashinfer_extend.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    print_table(info, rows)
    return 0


def print_table(info: dict, rows: list[dict]) -> None:
    print(f"\nMLA extend (192 / 128), {info['gpu']}, FlashInfer {info['flashinfer']}: us per CUDA-graph replay, "
          "TFLOP/s of the causal FLOPs; x = FlashInfer time / Triton default time (<1: FlashInfer faster)")
    print(f"{'H':>4} {'B':>3} {'new':>6} {'prefix':>6} {'triton us':>10} {'TF/s':>5} {'best us':>9} "
          + " ".join(f"{b + ' us':>9} {'TF/s':>5} {'x':>5} {'err':>7}" for b in FI_BACKENDS))
    for r in rows:
        line = f"{r['heads']:>4} {r['batch']:>3} {r['ext']:>6} {r['pre']:>6} {r['triton_us']:10.1f} " \
               f"{r['triton_tflops']:5.0f} {r['best_us']:9.1f}"
        for b in FI_BACKENDS:
            if f"{b}_us" in r:
                line += f" {r[b + '_us']:9.1f} {r[b + '_tflops']:5.0f} {r[b + '_us'] / r['triton_us']:5.2f}" \
                        f" {r[b + '_err_triton']:7.1e}"
            else:
                line += f" {'refused':>9} {'':5} {'':5} {'':7}"
        print(line)
    for r in rows:
        for b in FI_BACKENDS:
            if b + "_error" in r:
                print(f"refused ({r['heads']}, {r['batch']}x{r['ext']}+{r['pre']}, {b}): {r[b + '_error']}")
        if "triton_err_ref" in r:
            print(f"triton vs reference ({r['heads']}, {r['batch']}x{r['ext']}+{r['pre']}): {r['triton_err_ref']:.1e}")
    print("best Triton configs:", sorted({json.dumps(r["best_cfg"]) for r in rows}))


if __name__ == "__main__":
    sys.exit(main())
