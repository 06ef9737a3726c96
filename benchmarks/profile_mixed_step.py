"""Where a mixed prefill + decode step's GPU time goes, against the same prompt's chunks as plain extend steps.

    python benchmarks/profile_mixed_step.py --model deepseek-v2-lite --load-format dummy
    python benchmarks/profile_mixed_step.py --model tiny --load-format dummy --batch-size 4 --short-len 16 \
        --long-len 96 --chunk 32                                  # CPU: host time only
    python benchmarks/profile_mixed_step.py --model deepseek-v3 --num-layers 5 --batch-size 256 --short-len 1024 \
        --long-len 8192 --chunk 512 2048 8192 --steps off   # several chunk sizes: the cost of a prompt token

Per mode (--enable-mixed-chunk off, then on; one engine, a fresh scheduler per mode, radix cache off):
--batch-size requests of --short-len random tokens are prefilled and decode; then one prompt of --long-len
tokens arrives and is prefilled in chunks of --chunk tokens (the chunk budget counts the decodes when mixed).
Off, chunk steps and decode steps alternate; on, each chunk step carries one token of every running request.
The sequence runs three times per mode (other prompts each time): once to warm up, once with each step timed
between two device synchronisations, once more with each step also recorded by torch.profiler (so a step's
kernels are the ones it launched; the profiler slows the host, hence the unprofiled timing). Printed per step: its kind, wall
ms, summed kernel ms, and its five most expensive kernels; then the kernels whose time differs most between
the mixed steps and the plain chunk steps. With several --chunk sizes the sequence runs per size, and a last
table gives each size's mean step times and what one prompt token adds to a step (chunk step - decode step,
over the prompt tokens it carried). The prefill cap (--itl-target-ms) is off here: chunks are exactly --chunk.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernel_times(prof) -> dict[str, float]:
    """Kernel name -> summed device time (ms) over a profiled window (CUDA kernels only); host-side entries
    under "host:" names: self CPU ms of each op or runtime call, and "host calls:" their counts."""
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            out[e.key] = out.get(e.key, 0.0) + t / 1e3
        elif e.self_cpu_time_total:
            out["host:" + e.key] = out.get("host:" + e.key, 0.0) + e.self_cpu_time_total / 1e3
            out["host calls:" + e.key] = out.get("host calls:" + e.key, 0.0) + e.count
    return out


def _device_only(kernels: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in kernels.items() if not k.startswith("host")}


def _timed_step(eng, profiled: bool) -> tuple[str, float, dict[str, float]]:
    """One scheduler step between two device synchronisations: (kind, wall ms, kernel ms by name: recorded by
    torch.profiler when `profiled`, which also slows the host, else empty)."""
    from torch.profiler import ProfilerActivity, profile

    before = eng.scheduler.stats()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    prof = profile(activities=activities) if profiled else None
    if prof is not None:
        prof.start()
    t = time.perf_counter()
    eng.scheduler.step()
    _sync()
    wall = (time.perf_counter() - t) * 1e3
    if prof is not None:
        prof.stop()
    after = eng.scheduler.stats()
    kind = ("chunk" if after["extend_steps"] > before["extend_steps"]
            else "decode" if after["decode_steps"] > before["decode_steps"] else "idle")
    return kind, wall, _kernel_times(prof) if prof is not None else {}


def run_mode(eng, mixed: bool, a, chunk: int, seed: int, profiled: bool) -> list[tuple[str, float, dict[str, float]]]:
    """The sequence of the module docstring; its steps after the long prompt arrived, timed (`_timed_step`)."""
    eng.scheduler = eng.make_scheduler(enable_mixed_chunk=mixed, chunked_prefill_size=chunk,
                                       disable_radix_cache=True, itl_target_ms=-1)
    g = torch.Generator().manual_seed(seed)
    vocab = min(eng.config.vocab_size, 32000)
    short = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    for ids in torch.randint(3, vocab, (a.batch_size, a.short_len), generator=g).tolist():
        eng.scheduler.add(eng.make_request(ids, short))
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        eng.scheduler.step()
    for _ in range(4):
        eng.scheduler.step()
    long_ids = torch.randint(3, vocab, (a.long_len,), generator=g).tolist()
    eng.scheduler.add(eng.make_request(long_ids, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)))
    steps = []
    n = 2 * (a.long_len // max(chunk - a.batch_size, 1) + 2)
    for _ in range(n):
        steps.append(_timed_step(eng, profiled))
    eng.scheduler.abort_all()
    eng.scheduler.flush()
    eng.scheduler.take_outputs()
    return steps


def _top(kernels: dict[str, float], k: int = 5) -> str:
    return ", ".join(f"{name[:48]} {ms:.2f}" for name, ms in sorted(kernels.items(), key=lambda x: -x[1])[:k])


def _mean_kernels(steps, kind: str) -> dict[str, float]:
    chosen = [kt for k, _, kt in steps if k == kind]
    total = collections.Counter()
    for kt in chosen:
        total.update(kt)
    return {name: ms / max(len(chosen), 1) for name, ms in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch-size", type=int, default=32, help="decoding requests while the long prompt prefills")
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--long-len", type=int, default=6144)
    ap.add_argument("--chunk", type=int, nargs="+", default=[2048], help="--chunked-prefill-size (one or several)")
    ap.add_argument("--steps", choices=("on", "off"), default="on", help="print every profiled step")
    ap.add_argument("--wait-compiles", action="store_true",
                    help="measure after the engine's background Triton compiles of prefill kernels have finished "
                         "(by default they may still run, as in a server that has just started)")
    a = ap.parse_args()
    extra = {"quantization": a.quantization} if a.quantization else {}
    eng = Engine(model=a.model, load_format=a.load_format, num_layers=a.num_layers,
                 max_running_requests=a.batch_size + 1, chunked_prefill_size=max(a.chunk),
                 max_model_len=a.long_len + a.short_len + 512, **extra)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if a.wait_compiles and eng.runner.prefill_compiles is not None:
        t = time.perf_counter()
        n = eng.runner.prefill_compiles.wait()
        print(f"waited {time.perf_counter() - t:.1f} s for the background prefill compiles ({n} kernels)")
    rows = []
    for chunk in a.chunk:
        print(f"\n{a.model} ({a.load_format}, {eng.config.num_hidden_layers} layers) on {device}: {a.batch_size} "
              f"decoding requests of {a.short_len} prompt tokens, one prompt of {a.long_len} in chunks of {chunk}")
        rows += profile_chunk(eng, a, chunk)
    if len(a.chunk) > 1:
        print("\nper chunk size (mixed: the chunk counts the decode rows): mean wall ms without the profiler")
        print(f"{'chunk':>6} {'mode':>9} {'decode':>8} {'chunk':>8} {'prompt tok':>10} {'us/prompt tok':>13}")
        for chunk, name, decode_ms, chunk_ms in rows:
            prompt = chunk - a.batch_size if name == "mixed on" else chunk
            extra_ms = chunk_ms - (decode_ms if name == "mixed on" else 0.0)
            print(f"{chunk:>6} {name:>9} {decode_ms:8.2f} {chunk_ms:8.2f} {prompt:>10} {1e3 * extra_ms / prompt:13.1f}")


def profile_chunk(eng, a, chunk: int) -> list[tuple[int, str, float, float]]:
    """Both modes at one chunk size; printed as the module docstring says. Returns (chunk, mode, mean decode
    step ms, mean chunk step ms), unprofiled."""
    summary, timed, rows = {}, {}, []
    for mixed in (False, True):
        name = "mixed on" if mixed else "mixed off"
        run_mode(eng, mixed, a, chunk, seed=1, profiled=False)  # compiles, graph warm-up
        timed[name] = run_mode(eng, mixed, a, chunk, seed=3, profiled=False)
        steps = run_mode(eng, mixed, a, chunk, seed=2, profiled=True)
        if a.steps == "on":
            print(f"\n{name}: step kind, wall ms, kernel ms, top kernels (ms)")
            for kind, wall, kt in steps:
                if kind != "idle":
                    print(f"  {kind:>6} {wall:8.2f} {sum(_device_only(kt).values()):8.2f}  {_top(_device_only(kt))}")
        summary[name] = steps
    print("\nmean per step: kind, steps, wall ms without the profiler, wall ms and kernel ms under it")
    for name, steps in summary.items():
        bare_by_kind = {}
        for kind in ("chunk", "decode"):
            sel = [(w, sum(_device_only(kt).values())) for k, w, kt in steps if k == kind]
            bare = [w for k, w, _ in timed[name] if k == kind]
            bare_by_kind[kind] = sum(bare) / max(len(bare), 1)
            if sel:
                print(f"  {name:>9} {kind:>6} {len(sel):>3} {bare_by_kind[kind]:8.2f} "
                      f"{sum(w for w, _ in sel) / len(sel):8.2f} {sum(g for _, g in sel) / len(sel):8.2f}")
        rows.append((chunk, name, bare_by_kind["decode"], bare_by_kind["chunk"]))
    off = _mean_kernels(summary["mixed off"], "chunk")
    on = _mean_kernels(summary["mixed on"], "chunk")
    for title, prefix in (("kernels (device ms)", None), ("host ops and runtime calls (self CPU ms)", "host:"),
                          ("host ops and runtime calls (count)", "host calls:")):
        names = [n for n in set(off) | set(on)
                 if (n.startswith(prefix) if prefix else not n.startswith("host"))]
        diff = sorted(names, key=lambda n: -abs(on.get(n, 0.0) - off.get(n, 0.0)))[:12]
        print(f"\n{title} whose mean per chunk step differs most: mixed on, off")
        for n in diff:
            print(f"  {on.get(n, 0.0):9.2f} {off.get(n, 0.0):9.2f}  {n[:100]}")
    return rows


if __name__ == "__main__":
    main()
