"""Time `sample_async` on one batch of logits [N, V] for a few parameter mixes (CPU or GPU).

    python benchmarks/bench_sampler.py --n 64 --vocab 129280 [--device cuda] [--module path/to/old_sampling.py]

Prints one line per mix: the fastest and the median time of a call (including the device->host copy of the
results); on a shared machine the fastest is the steadier number.
`--module` times another copy of engine/sampling.py (an older version) with the same inputs; the
penalty mix needs the current version (it passes a History).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from engine import sampling


def _mixes(sp, n: int, v: int, history_len: int) -> dict:
    p = sp.SamplingParams
    seeded = [p(temperature=0.8, top_p=0.9, top_k=50, seed=i) for i in range(n)]
    mixes = {
        "greedy": [p(temperature=0) for _ in range(n)],
        "temperature": [p(temperature=0.7) for _ in range(n)],
        "top_p+top_k+seed": seeded,
        "min_p": [p(temperature=1.0, min_p=0.05) for _ in range(n)],
        "top_p": [p(temperature=1.0, top_p=0.9) for _ in range(n)],
    }
    if sp is sampling:  # the current version only
        mixes["temperature+penalties+bias"] = [p(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3,
                                                 repetition_penalty=1.1, logit_bias={7: 5.0}) for _ in range(n)]
    return mixes


def _time(fn, repeat: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--history", type=int, default=1000, help="prompt + output tokens per row (penalties)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--module", default=None, help="time this copy of sampling.py instead")
    args = ap.parse_args()
    sp = sampling
    if args.module:
        spec = importlib.util.spec_from_file_location("old_sampling", args.module)
        sp = importlib.util.module_from_spec(spec)
        sys.modules["old_sampling"] = sp  # dataclasses look their module up there
        spec.loader.exec_module(sp)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.n, args.vocab, generator=g) * 3).to(dev, torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.n, args.history), generator=g).tolist()
    history = sampling.History(token_ids=ids, prompt_lens=[args.history // 2] * args.n, pending=[0] * args.n)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for name, params in _mixes(sp, args.n, args.vocab, args.history).items():
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        extra = (history,) if sp is sampling else ()

        def call():
            sp.sample_async(logits, params, gens, *extra).resolve()
            sync()

        fastest, median = _time(call, args.repeat)
        print(f"{name:28s} N={args.n} V={args.vocab} {args.device}: fastest {fastest * 1e3:8.2f} ms, "
              f"median {median * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
