"""Decode-step benchmark of a truncated DeepSeek-V3 (dummy FP8 weights) on one GPU, next to its bytes floor.

    python benchmarks/bench_decode.py [--num-layers 5] [--batch-sizes 1,8,32,128] [--modes eager,graph,compile]
                                      [--kv-dtypes auto,fp8_e4m3] [--attention-backends triton,flashinfer]

For each attention backend, KV dtype (bf16, fp8_e4m3) and mode (eager, CUDA graph, CUDA graph +
torch.compile) it runs `bench one-batch` (input 256, output 32) and reports the
median decode step. The floor of a step is the bytes it must read once (every
weight it touches: attention, dense MLP, shared expert, the routed experts the
batch's tokens select (expected count under uniform routing), gate, embedding rows,
lm_head; plus the latent KV cache it attends over) at the device-to-device copy
bandwidth measured in the same run. A per-layer table (eager, CUDA events around
each decoder layer) shows where the time goes. Last: an extrapolation to 61 layers.
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
from engine.config import parse_config  # noqa: E402
from engine.models import lookup  # noqa: E402

IN_LEN, OUT_LEN = 256, 32


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n / statistics.median(times)


def layer_bytes(cfg, layer: int, bs: int, ctx: int, kv_bytes: int, weight_bytes: int = 1) -> dict:
    """Bytes one decode step must read for one layer (weight_bytes per weight: 1 for FP8, scales ignored;
    2 for bf16)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_lora = cfg.q_lora_rank
    q = h * q_lora + q_lora * heads * cfg.qk_head_dim if q_lora else h * heads * cfg.qk_head_dim  # V2-Lite: no q LoRA
    attn = (q + h * cfg.kv_cache_dim
            + heads * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h)
    kv = bs * ctx * cfg.kv_cache_dim * kv_bytes
    if cfg.is_moe_layer(layer):
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** bs)
        per_expert = 3 * h * cfg.moe_intermediate_size
        mlp = (touched + cfg.n_shared_experts) * per_expert + e * h * 2  # + bf16 gate
    else:
        mlp = 3 * h * cfg.intermediate_size
    return {"weights": (attn + mlp) * weight_bytes, "kv": kv}


def step_floor_s(cfg, n_layers: int, bs: int, ctx: int, kv_bytes: int, bw: float, weight_bytes: int = 1) -> float:
    total = sum(sum(layer_bytes(cfg, i, bs, ctx, kv_bytes, weight_bytes).values()) for i in range(n_layers))
    total += cfg.vocab_size * cfg.hidden_size * 2 + bs * cfg.hidden_size * 2  # lm_head + embedding rows
    return total / bw


def serving_floor_ms(model: str, n_layers: int, bs: int, ctx: int, bw: float) -> float:
    """The bytes floor of one decode step of a served registry model (dummy weights: FP8 where the
    checkpoint is block-FP8, else bf16; bf16 KV) at batch bs and context ctx, in ms."""
    cfg = parse_config(lookup(model).config_dict())
    return step_floor_s(cfg, n_layers or cfg.num_hidden_layers, bs, ctx, 2, bw, 1 if cfg.fp8 else 2) * 1e3


def per_layer_times(args: EngineArgs, bs: int) -> list[float]:
    """Eager decode step with CUDA events around each decoder layer: median ms per layer."""
    from dsctl.bench_one_batch import _run_batch
    from engine.runner import ModelRunner

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

    _run_batch(runner, bs, 16, 2, 0)
    hooks = []
    for i, layer in enumerate(runner.model.layers):
        hooks += [layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i))]
    _run_batch(runner, bs, IN_LEN, OUT_LEN, 0)
    torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    out = [statistics.median(s.elapsed_time(e) for s, e in evs[1:]) for _, evs in sorted(events.items())]
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


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
        floor = step_floor_s(cfg, n_layers, r.batch_size, IN_LEN + OUT_LEN // 2, kvb, bw)
        rows.append({**key, "bs": r.batch_size, "decode_ms": r.median_decode_latency_s * 1e3,
                     "floor_ms": floor * 1e3, "x_floor": r.median_decode_latency_s / floor,
                     "prefill_ms": r.prefill_latency_s * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--modes", default="eager,graph,compile")
    ap.add_argument("--kv-dtypes", default="auto,fp8_e4m3")
    ap.add_argument("--attention-backends", default="triton", help="comma-separated: triton, flashinfer")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-per-layer", dest="per_layer", action="store_false", help="skip the per-layer table")
    opts = ap.parse_args()
    sizes = [int(x) for x in opts.batch_sizes.split(",")]
    cfg = parse_config(lookup("deepseek-v3").config_dict())
    bw = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    base = EngineArgs.of(model="deepseek-v3", load_format="dummy", num_layers=opts.num_layers,
                      cuda_graph_bs=",".join(map(str, sizes)), max_running_requests=max(sizes))
    rows = []
    for attn in opts.attention_backends.split(","):
        for kv in opts.kv_dtypes.split(","):
            for mode in opts.modes.split(","):
                args = base.replace(attention_backend=attn, kv_cache_dtype=kv, disable_cuda_graph=mode == "eager",
                                    enable_torch_compile=mode == "compile", torch_compile_max_bs=max(sizes))
                rows += run_case(args, cfg, sizes, bw, opts.num_layers, dict(attn=attn, kv=kv, mode=mode))
    layers = {bs: per_layer_times(base, bs) for bs in (sizes[0], sizes[-1])} if opts.per_layer else {}
    with open(os.path.join(opts.out, "bench_decode.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": rows, "layers": layers}, f)
    print_tables(cfg, rows, layers, bw, opts.num_layers)


def print_tables(cfg, rows, layers, bw, n_layers) -> None:
    print("\nPer-layer decode (eager, CUDA events), ms vs bytes floor (bf16 KV, ctx ~272):")
    for bs, times in layers.items():
        for i, t in enumerate(times):
            fl = sum(layer_bytes(cfg, i, bs, IN_LEN + OUT_LEN // 2, 2).values()) / bw * 1e3
            kind = "moe" if cfg.is_moe_layer(i) else "dense"
            print(f"  bs={bs:<4} layer {i} ({kind:5}) {t:8.3f} ms   floor {fl:7.3f} ms   x{t / fl:5.2f}")
    print("\nDecode step (median of 31), DeepSeek-V3 dummy FP8 weights,", n_layers, "layers:")
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
              f"{r['x_floor']:8.2f} {r['bs'] / r['decode_ms'] * 1e3:9.0f} {ext:12.1f}  (x{speed:.2f} vs eager)")


if __name__ == "__main__":
    main()
