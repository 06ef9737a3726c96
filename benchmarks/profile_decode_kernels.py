"""Kernels launched per decode step, and per decoder layer, counted with torch.profiler (issue 35, item 2).

    python benchmarks/profile_decode_kernels.py                      # V3 shapes, 5 layers, dummy FP8, batch 1
    python benchmarks/profile_decode_kernels.py --tree .peer/before  # the same with another checkout's engine
    python benchmarks/profile_decode_kernels.py --model tiny --num-layers 2 --layer-delta   # CPU: host ops only

One engine per layer count (dummy weights, CUDA graphs off so that every kernel is seen as it launches: a
graph replays the same kernels), --batch-size requests of --input-len random tokens prefilled, --warmup decode
steps, then --steps decode steps under the profiler. Printed: kernels per decode step, per layer
(kernels per step / layers, embedding, final norm, logits and sampling included) and the kernel names with
their launches per step. With --layer-delta a second engine with one layer more runs the same steps: the
difference is exactly one decoder layer's kernels (for V3 at 5 -> 6 layers: a MoE layer; the first three
are dense). Extra engine flags go after --, e.g. `-- --norm-quant-backend off`.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch


def _import_engine(tree: str):
    sys.path.insert(0, os.path.abspath(tree))
    from engine.engine import Engine  # lazy: from the checkout --tree names
    from engine.sampling import SamplingParams  # lazy: from the checkout --tree names

    return Engine, SamplingParams


def _flags(extra: list[str]) -> dict:
    """`--norm-quant-backend off --gemm-backend triton` -> {"norm_quant_backend": "off", ...} (values as text,
    `--flag` alone -> True)."""
    out, i = {}, 0
    while i < len(extra):
        key = extra[i].lstrip("-").replace("-", "_")
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            out[key], i = extra[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


def count_kernels(a, layers: int, Engine, SamplingParams) -> tuple[collections.Counter, collections.Counter, int]:
    """(launches per kernel name over the profiled steps, their device microseconds, decode steps profiled)."""
    from torch.profiler import ProfilerActivity, profile  # lazy: only when profiling

    eng = Engine(model=a.model, load_format="dummy", num_layers=layers, disable_cuda_graph=True,
                 max_running_requests=max(a.batch_size, 1), max_model_len=a.input_len + a.warmup + a.steps + 64,
                 **_flags(a.extra))
    g = torch.Generator().manual_seed(0)
    vocab = min(eng.config.vocab_size, 32000)
    params = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    for ids in torch.randint(3, vocab, (a.batch_size, a.input_len), generator=g).tolist():
        eng.scheduler.add(eng.make_request(ids, params))
    while eng.scheduler.waiting or getattr(eng.scheduler, "prefilling", None) is not None:
        eng.scheduler.step()
    for _ in range(a.warmup):
        eng.scheduler.step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    before = eng.scheduler.stats()["decode_steps"]
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(a.steps):
            eng.scheduler.step()
        if cuda:
            torch.cuda.synchronize()
    steps = eng.scheduler.stats()["decode_steps"] - before
    counts, micros = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        on_device = getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
        if on_device or (not cuda and e.key.startswith("aten::")):  # CPU: torch ops stand in for kernels
            counts[e.key] += e.count
            micros[e.key] += getattr(e, "self_device_time_total", 0.0) if on_device else 0.0
    eng.scheduler.abort_all()
    eng.close()
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return counts, micros, max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layer-delta", action="store_true", help="also run num-layers + 1: one layer's kernels")
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout whose engine runs (default: this one)")
    ap.add_argument("extra", nargs="*", help="engine flags after --")
    a = ap.parse_args()
    Engine, SamplingParams = _import_engine(a.tree)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (torch ops, not kernels)"
    print(f"{a.model}, dummy weights, batch {a.batch_size}, {a.input_len} prompt tokens, CUDA graphs off, "
          f"engine from {os.path.abspath(a.tree)}, on {device}; extra flags: {' '.join(a.extra) or 'none'}")
    per_step = {}
    for layers in [a.num_layers] + ([a.num_layers + 1] if a.layer_delta else []):
        counts, micros, steps = count_kernels(a, layers, Engine, SamplingParams)
        per_step[layers] = {k: v / steps for k, v in counts.items()}
        total = sum(per_step[layers].values())
        busy = sum(micros.values()) / steps
        print(f"\n{layers} layers: {total:.1f} kernels per decode step ({steps} steps), {total / layers:.1f} per "
              f"layer (whole step / layers); {busy:.1f} us of kernel time per step (eager, no overlap counted)")
        print("  launches/step  us/step  kernel")
        for name, n in sorted(per_step[layers].items(), key=lambda kv: -micros[kv[0]])[:40]:
            print(f"  {n:13.2f}  {micros[name] / steps:7.1f}  {name[:100]}")
    if a.layer_delta:
        lo, hi = per_step[a.num_layers], per_step[a.num_layers + 1]
        diff = {k: hi.get(k, 0.0) - lo.get(k, 0.0) for k in set(lo) | set(hi)}
        print(f"\nlayer {a.num_layers} alone (the difference): {sum(diff.values()):.1f} kernels per decode step")
        for name, n in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
            if abs(n) > 0.01:
                print(f"  {n:7.2f}  {name[:110]}")


if __name__ == "__main__":
    main()
