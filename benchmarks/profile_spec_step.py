"""Where a speculative step's time goes: host functions (cProfile) and device work (torch.profiler).

    python benchmarks/profile_spec_step.py --model tiny-py --batch-size 8
    python benchmarks/profile_spec_step.py --model deepseek-v3 --load-format dummy --num-layers 5 --batch-size 1

`bs` requests of --input-len random tokens are prefilled, a few spec steps warm up, then --steps spec
steps run under cProfile (top functions by cumulative time) and under torch.profiler (top CUDA kernels,
and the host-side CUDA runtime calls that wait: synchronisations and copies).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def _steps(eng, n: int) -> float:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    for _ in range(n):
        eng.scheduler.step()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-py")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tree", default="2,4,4", help="steps,topk,nodes")
    a = ap.parse_args()
    steps, topk, nodes = (int(x) for x in a.tree.split(","))
    eng = Engine(model=a.model, load_format=a.load_format, num_layers=a.num_layers,
                 max_running_requests=a.batch_size, speculative_algorithm="NEXTN", speculative_num_steps=steps,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes)
    p = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for ids in torch.randint(3, min(eng.config.vocab_size, 32000), (a.batch_size, a.input_len), generator=g).tolist():
        eng.scheduler.add(eng.make_request(ids, p))
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        eng.scheduler.step()
    spec = eng.scheduler.spec
    _steps(eng, 5)
    t_spec = _steps(eng, a.steps)
    prof = cProfile.Profile()
    prof.enable()
    _steps(eng, a.steps)
    prof.disable()
    print(f"\n{a.model} batch {a.batch_size}, tree {a.tree}: spec step {t_spec * 1e3:.2f} ms "
          f"(accepted length so far {spec.stats.mean:.2f})")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            _steps(eng, a.steps)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
