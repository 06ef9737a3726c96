"""Decode-step benchmark of a DeepSeek model (dummy weights) on one GPU, next to its bytes floor.

    python benchmarks/bench_decode.py [--model deepseek-v3] [--num-layers 5] [--batch-sizes 1,8,32,128]
                                      [--modes eager,graph,compile] [--kv-dtypes auto,fp8_e4m3]
                                      [--attention-backends triton,flashinfer] [--kernel-table 1,32]
    python benchmarks/bench_decode.py --model deepseek-v2-lite --num-layers 0 --modes graph --kv-dtypes auto

--num-layers 0 = the model's full depth. Weights are dummy FP8 where the checkpoint is block-FP8
(DeepSeek-V3/R1), else bf16 (V2, V2-Lite); the floor counts 1 or 2 bytes per weight accordingly.
--kernel-table BS,...: a torch-profiler table of one eager decode step per batch size (CUDA time per
kernel name, summed over layers): where a step's time goes.

For each attention backend, KV dtype (bf16, fp8_e4m3) and mode (eager, CUDA graph, CUDA graph +
torch.compile) it runs `bench one-batch` (input 256, output 32) and reports the
median decode step. The floor of a step is the bytes it must read once (every
weight it touches: attention, dense MLP, shared expert, the routed experts the
batch's tokens select (expected count under uniform routing), gate, embedding rows,
lm_head; plus the latent KV cache it attends over) at the device-to-device copy
bandwidth measured in the same run (engine/distributed/step_floor.py, which `dsctl bench one-batch`
uses too). A per-layer table (eager, CUDA events around each decoder layer) shows where the time
goes. Last: an extrapolation to 61 layers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsctl.bench_one_batch import run_one_batch  # noqa: E402
from engine.args import EngineArgs  # noqa: E402
from engine.checkpoint.config import parse_config  # noqa: E402
from engine.checkpoint.registry import lookup  # noqa: E402
from engine.distributed.step_floor import copy_bandwidth, layer_bytes, step_floor_s  # noqa: E402

IN_LEN, OUT_LEN = 256, 32


def per_layer_times(args: EngineArgs, bs: int) -> list[float]:
    """Eager decode step with CUDA events around each decoder layer: median ms per layer."""
    from dsctl.bench_one_batch_timing import run_batch
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(args.replace(disable_cuda_graph=True, max_total_tokens=bs * (IN_LEN + OUT_LEN),
                                      max_running_requests=max(bs, 8), max_model_len=IN_LEN + OUT_LEN))
    events: dict[int, list] = {}

    def pre(i):
        def hook(mod, inp):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.setdefault(i, []).append([ev, None])
        return hook

    def post(i):
        def hook(mod, inp, out):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events[i][-1][1] = ev
        return hook

    run_batch(runner, bs, 16, 2, 0)
    hooks = []
    for i, layer in enumerate(runner.model.layers):
        hooks += [layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i))]
    run_batch(runner, bs, IN_LEN, OUT_LEN, 0)
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    out = [statistics.median(s.elapsed_time(e) for s, e in evs[1:]) for _, evs in sorted(events.items())]
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _cuda_kernel_ms(fn) -> dict[str, list]:
    """{kernel name: [calls, ms]} of the CUDA kernels fn() runs, under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(ev.name[:90], [0, 0.0])
            t[0] += 1
            t[1] += ev.device_time_total / 1e3
    return totals


def kernel_table(args: EngineArgs, bs: int, top: int = 18) -> list[tuple[str, float, float]]:
    """(kernel name, calls per step, ms per step) of eager decode steps, largest first: a prefill plus
    `steps` decode steps minus the same prefill alone, per kernel name, over `steps`."""
    from dsctl.bench_one_batch_timing import run_batch
    from engine.runner.model_runner import ModelRunner

    steps = 4
    runner = ModelRunner(args.replace(disable_cuda_graph=True, max_total_tokens=bs * (IN_LEN + steps + 2),
                                      max_running_requests=max(bs, 8), max_model_len=IN_LEN + steps + 2))
    run_batch(runner, bs, IN_LEN, 3, 0)  # compile and warm up outside the traces
    prefill = _cuda_kernel_ms(lambda: run_batch(runner, bs, IN_LEN, 1, 0))
    both = _cuda_kernel_ms(lambda: run_batch(runner, bs, IN_LEN, steps + 1, 0))
    runner = None  # free its memory before the next engine (the lambdas share this cell)
    gc.collect()
    torch.cuda.empty_cache()
    rows = []
    for name, (calls, ms) in both.items():
        c0, ms0 = prefill.get(name, (0, 0.0))
        if calls > c0:
            rows.append((name, (calls - c0) / steps, max(ms - ms0, 0.0) / steps))
    return sorted(rows, key=lambda r: -r[2])[:top]


def run_case(args: EngineArgs, cfg, sizes, bw, n_layers, key: dict) -> list[dict]:
    """`bench one-batch` rows for one backend / KV dtype / mode; a failure becomes one error row."""
    try:
        res = run_one_batch(args, sizes, IN_LEN, OUT_LEN, None, None)
    except Exception as exc:  # record and go on: one failing mode must not hide the others
        print(f"FAILED {key}: {type(exc).__name__}: {exc}", flush=True)
        return [{**key, "error": f"{type(exc).__name__}: {exc}"[:300]}]
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    for r in res:
        kvb = 1 if key["kv"] == "fp8_e4m3" else 2
        floor = step_floor_s(cfg, n_layers, r.batch_size, IN_LEN + OUT_LEN // 2, kvb, bw, 1 if cfg.fp8 else 2)
        rows.append({**key, "bs": r.batch_size, "decode_ms": r.median_decode_latency_s * 1e3,
                     "floor_ms": floor * 1e3, "x_floor": r.median_decode_latency_s / floor,
                     "prefill_ms": r.prefill_latency_s * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3", help="registry alias (dummy weights)")
    ap.add_argument("--num-layers", type=int, default=5, help="0: the model's full depth")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--modes", default="eager,graph,compile")
    ap.add_argument("--kv-dtypes", default="auto,fp8_e4m3")
    ap.add_argument("--attention-backends", default="triton", help="comma-separated: triton, flashinfer")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-per-layer", dest="per_layer", action="store_false", help="skip the per-layer table")
    ap.add_argument("--kernel-table", default="", help="batch sizes for a per-kernel profile of an eager step")
    ap.add_argument("--norms", default="triton", help="comma-separated: triton (kernels/rms_norm.py, the "
                    "engine's CUDA path), torch (the ~7-kernel torch form, for comparison)")
    opts = ap.parse_args()
    sizes = [int(x) for x in opts.batch_sizes.split(",")]
    cfg = parse_config(lookup(opts.model).config_dict())
    n_layers = opts.num_layers or cfg.num_hidden_layers
    bw = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    base = EngineArgs.of(model=opts.model, load_format="dummy", num_layers=opts.num_layers or None,
                      cuda_graph_bs=",".join(map(str, sizes)), max_running_requests=max(sizes))
    rows = []
    from kernels import rms_norm

    kernel_max_hidden = rms_norm.MAX_HIDDEN
    for norm in opts.norms.split(","):
        rms_norm.MAX_HIDDEN = kernel_max_hidden if norm == "triton" else 0  # 0: no row fits, the torch form runs
        for attn in opts.attention_backends.split(","):
            for kv in opts.kv_dtypes.split(","):
                for mode in opts.modes.split(","):
                    args = base.replace(attention_backend=attn, kv_cache_dtype=kv, disable_cuda_graph=mode == "eager",
                                        enable_torch_compile=mode == "compile", torch_compile_max_bs=max(sizes))
                    key = dict(attn=attn, kv=kv, mode=mode, **({"norm": norm} if len(opts.norms.split(",")) > 1 else {}))
                    rows += run_case(args, cfg, sizes, bw, n_layers, key)
    rms_norm.MAX_HIDDEN = kernel_max_hidden
    layers = {bs: per_layer_times(base, bs) for bs in (sizes[0], sizes[-1])} if opts.per_layer else {}
    kernels = {int(b): kernel_table(base, int(b)) for b in opts.kernel_table.split(",") if b}
    with open(os.path.join(opts.out, "bench_decode.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "model": opts.model, "copy_GBps": bw / 1e9, "rows": rows,
                   "layers": layers, "kernels": kernels}, f)
    for bs, table in kernels.items():
        print(f"\nKernels of one eager decode step, bs={bs} ({opts.model}, {n_layers} layers; GPU ms per step):")
        for name, calls, ms in table:
            print(f"  {ms:8.3f} ms  {calls:6.0f} calls  {name}")
    print_tables(cfg, rows, layers, bw, n_layers, opts.model)


def print_tables(cfg, rows, layers, bw, n_layers, model="deepseek-v3") -> None:
    wb = 1 if cfg.fp8 else 2
    print("\nPer-layer decode (eager, CUDA events), ms vs bytes floor (bf16 KV, ctx ~272):")
    for bs, times in layers.items():
        for i, t in enumerate(times):
            fl = sum(layer_bytes(cfg, i, bs, IN_LEN + OUT_LEN // 2, 2, wb).values()) / bw * 1e3
            kind = "moe" if cfg.is_moe_layer(i) else "dense"
            print(f"  bs={bs:<4} layer {i} ({kind:5}) {t:8.3f} ms   floor {fl:7.3f} ms   x{t / fl:5.2f}")
    print(f"\nDecode step (median of 31), {model} dummy {'FP8' if cfg.fp8 else 'bf16'} weights,", n_layers, "layers:")
    print(f"{'attn':10} {'kv':9} {'mode':8} {'bs':>4} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>9} "
          f"{'x61/n ms':>12}")
    eager = {(r['attn'], r['kv'], r['bs']): r['decode_ms'] for r in rows if r['mode'] == 'eager' and 'bs' in r}
    for r in rows:
        if "error" in r:
            print(f"{r['attn']:10} {r['kv']:9} {r['mode']:8} FAILED: {r['error'][:80]}")
            continue
        ext = r["decode_ms"] * 61 / n_layers  # upper bound: the lm_head share is scaled too
        speed = eager.get((r["attn"], r["kv"], r["bs"]), math.nan) / r["decode_ms"]
        print(f"{r['attn']:10} {r['kv']:9} {r['mode']:8} {r['bs']:>4} {r['decode_ms']:9.3f} {r['floor_ms']:9.3f} "
              f"{r['x_floor']:8.2f} {r['bs'] / r['decode_ms'] * 1e3:9.0f} {ext:12.1f}  (x{speed:.2f} vs eager)"
              + (f"  norm={r['norm']}" if "norm" in r else ""))


if __name__ == "__main__":
    main()
