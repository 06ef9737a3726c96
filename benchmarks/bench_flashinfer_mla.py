"""FlashInfer's MLA decode (its fa2 and fa3 kernels) next to dsctl's Triton MLA decode, same problems.

    python benchmarks/bench_flashinfer_mla.py [--heads 16,128] [--batches 1,8,32,128] [--contexts 1024,4096,16384]

Cases are bench_mla.py's: random queries, a random latent cache (512 + 64) scattered over
token-granular slots (FlashInfer sees it as pages of one token, as the engine passes it),
bf16 and FP8 (e4m3) KV. Every kernel is first checked against `mla_decode_ref` (float32,
same cache), then timed as one CUDA-graph replay (FlashInfer planned on the host before
capture, as the engine does), median of do_bench with L2 flushed before every replay.
GB/s counts the KV bytes read once. A backend FlashInfer refuses for a case is reported as
such. Then the host cost of planning one CUDA-graph decode step (the engine's FlashInferAttentionBackend,
`--plan-only` for this table alone): FlashInfer's public plan(), the re-plan of a wrapper that gathers the
batch's pages into its own buffer, and the engine's default, a wrapper that reads the request table in place
(its output checked against the gathering one's).
Prints the tables last; writes bench_flashinfer_mla.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mla import (  # noqa: E402
    DEV,
    FP8,
    LKV,
    ROPE,
    SM_SCALE,
    DecodeCase,
    bench_graph,
    decode_bytes,
    measure_ceilings,
    rel_err,
    time_decode,
)

from kernels.mla_decode import default_config, mla_decode_ref  # noqa: E402
from tuning.mla_decode import flashinfer_decode_fn  # noqa: E402

FI_BACKENDS = ("fa2", "fa3")


def flashinfer_fn(case: DecodeCase, q, q_pe, kv_dtype, backend: str, workspace: torch.Tensor, out: torch.Tensor):
    """Plan a FlashInfer MLA wrapper for the case; return the run closure (capturable)."""
    kv, scale = case.cache(kv_dtype)
    return flashinfer_decode_fn(workspace, q, q_pe, kv, scale, case.table, SM_SCALE, out, backend=backend)


def run_case(case: DecodeCase, heads: int, kv_dtype, workspace) -> dict:
    q, q_pe = case.queries(heads)
    kv, scale = case.cache(kv_dtype)
    ref = mla_decode_ref(q, q_pe, kv, case.table, case.rows, case.seq_lens, SM_SCALE, kv_scale=scale)
    row = {"heads": heads, "kv": "fp8" if kv_dtype == FP8 else "bf16", "batch": case.batch, "ctx": case.ctx,
           "triton_us": time_decode(case, heads, kv_dtype, default_config(heads, kv_dtype)) * 1e3}
    for backend in FI_BACKENDS:
        out = torch.full_like(q, float("nan"))
        try:
            fn = flashinfer_fn(case, q, q_pe, kv_dtype, backend, workspace, out)
            fn()
            torch.cuda.synchronize()
            row[f"{backend}_err"] = rel_err(out, ref) if not out.isnan().any() else float("nan")
            row[f"{backend}_us"] = bench_graph(fn) * 1e3
        except Exception as exc:  # an unsupported (backend, dtype, shape) must not hide the other cases
            row[f"{backend}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


PLAN_MODES = {"public_plan_us": dict(fast_replan=False, in_place=False),  # FlashInfer's plan() every step
              "gather_replan_us": dict(in_place=False),  # pages gathered into the wrappers' buffer, then re-plan
              "in_place_us": {}}  # the engine's default: the request table read in place, re-plan


def plan_overhead(batches=(1, 32, 128), ctx=4096, reps=50) -> list[dict]:
    """Host microseconds of begin_forward for a CUDA-graph decode batch in each of PLAN_MODES (the first, capture-time
    plan not counted), whether the gathered re-plan keeps the captured schedule layout, and the in-place wrapper's
    attention output against the gathering one's on a random cache (max abs difference; 0 expected)."""
    import time

    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.memory.pools import ReqToTokenPool
    from engine.model.attention_flashinfer import FlashInferAttentionBackend
    from engine.model.context import ForwardContext

    rows = []
    g = torch.Generator(device=DEV).manual_seed(0)
    for bs in batches:
        table = ReqToTokenPool(bs, ctx + 1, torch.device(DEV))
        table.table[:bs, :ctx] = torch.randperm(bs * ctx, device=DEV).view(bs, ctx).to(torch.int32) + 1

        def batch(lens):
            return ForwardBatch.build(ForwardMode.DECODE, [0] * bs, list(range(bs)), [n - 1 for n in lens],
                                      [1] * bs, torch.zeros(bs, dtype=torch.int64), list(range(bs)), torch.device(DEV))
        fbs = [batch([ctx - (i * 37 + r) % 512 for i in range(bs)]) for r in range(reps)]
        out, backends = {"bs": bs, "ctx": ctx}, {}
        for name, attrs in PLAN_MODES.items():
            backend = FlashInferAttentionBackend(128, LKV, ROPE, SM_SCALE, torch.bfloat16, torch.bfloat16, 1.0,
                                                 torch.device(DEV), ctx + 1, max_graph_bs=bs)
            for k, v in attrs.items():
                setattr(backend, k, v)
            ctx_ = ForwardContext(None, table, None, backend, moe_backend=None)
            backend.begin_forward(fbs[0], ctx_, graph_bs=bs)  # the capture-time plan
            backends[name] = (backend, ctx_)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for fb in fbs:
                backend.begin_forward(fb, ctx_, graph_bs=bs)
            torch.cuda.synchronize()
            out[name] = (time.perf_counter() - t) / reps * 1e6
        gather, gctx = backends["gather_replan_us"]
        captured = list(gather.graph_wrappers[bs]._planned_backend._plan_info)
        gather.fast_replan = False  # one more public plan: does the schedule layout stay what was captured?
        gather.begin_forward(fbs[-1], gctx, graph_bs=bs)
        out["plan_info_stable"] = list(gather.graph_wrappers[bs]._planned_backend._plan_info) == captured
        cache = torch.randn(bs * ctx + 1, 1, LKV + ROPE, device=DEV, generator=g).to(torch.bfloat16)
        q = (torch.randn(bs, 128, LKV, device=DEV, generator=g).to(torch.bfloat16),
             torch.randn(bs, 128, ROPE, device=DEV, generator=g).to(torch.bfloat16))
        outs = []
        for name in ("gather_replan_us", "in_place_us"):
            backend, ctx_ = backends[name]
            backend.begin_forward(fbs[-1], ctx_, graph_bs=bs)
            outs.append(backend.graph_wrappers[bs].run(query=q, kv_cache=cache).float())
        out["in_place_max_abs_diff"] = float((outs[0] - outs[1]).abs().max())
        out["in_place"] = backends["in_place_us"][0].in_place
        rows.append(out)
        print(json.dumps(out), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--plan-only", action="store_true", help="only the planning-cost table")
    opts = ap.parse_args()
    import flashinfer

    ceil = measure_ceilings()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__,
            **ceil}
    print(json.dumps(info), flush=True)
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=DEV)
    rows = []
    for ctx in ([] if opts.plan_only else map(int, opts.contexts.split(","))):
        for batch in map(int, opts.batches.split(",")):
            case = DecodeCase(batch, ctx)
            for heads in map(int, opts.heads.split(",")):
                for kv_dtype in (torch.bfloat16, FP8):
                    rows.append(run_case(case, heads, kv_dtype, workspace))
                    print(json.dumps(rows[-1]), flush=True)
            del case
            torch.cuda.empty_cache()
    plans = plan_overhead()
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "bench_flashinfer_mla.json").write_text(json.dumps({**info, "rows": rows, "plan": plans},
                                                                         indent=1))
    print_table(info, rows)
    print("\nHost cost of planning one CUDA-graph decode step (128 heads, ctx 4096), us:")
    for p in plans:
        print(f"  bs {p['bs']:>4}: public plan() {p['public_plan_us']:8.1f}   gathered re-plan {p['gather_replan_us']:8.1f}"
              f"   in place {p['in_place_us']:8.1f} (used: {p['in_place']}, max abs diff vs gathered "
              f"{p['in_place_max_abs_diff']:.2e})   plan_info unchanged: {p['plan_info_stable']}")
    return 0


def print_table(info: dict, rows: list[dict]) -> None:
    print(f"\nMLA decode, {info['gpu']}, FlashInfer {info['flashinfer']}, copy {info['copy_gbs']:.0f} GB/s; "
          "us per CUDA-graph replay; GB/s of KV; x = Triton time / FlashInfer time (>1: FlashInfer faster)")
    print(f"{'H':>4} {'kv':>4} {'B':>4} {'ctx':>6} {'triton us':>10} {'GB/s':>6} "
          + " ".join(f"{b + ' us':>9} {'GB/s':>6} {'x':>5} {'err':>7}" for b in FI_BACKENDS))
    for r in rows:
        kvb = decode_bytes(r["batch"], r["ctx"], FP8 if r["kv"] == "fp8" else torch.bfloat16)
        line = f"{r['heads']:>4} {r['kv']:>4} {r['batch']:>4} {r['ctx']:>6} {r['triton_us']:10.1f} " \
               f"{kvb / r['triton_us'] / 1e3:6.0f}"
        for b in FI_BACKENDS:
            if f"{b}_us" in r:
                line += f" {r[b + '_us']:9.1f} {kvb / r[b + '_us'] / 1e3:6.0f} {r['triton_us'] / r[b + '_us']:5.2f}" \
                        f" {r[b + '_err']:7.1e}"
            else:
                line += f" {'refused':>9} {'':6} {'':5} {'':7}"
        print(line)
    errors = {(r["heads"], r["kv"], b): r[b + "_error"] for r in rows for b in FI_BACKENDS if b + "_error" in r}
    for key, msg in sorted(errors.items()):
        print(f"refused {key}: {msg}")


if __name__ == "__main__":
    sys.exit(main())
