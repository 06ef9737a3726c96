"""Offline generation throughput through the scheduler (as `dsctl serve` runs it), per attention backend.

    python benchmarks/bench_offline_throughput.py [--attention-backends triton,flashinfer] [--batch-sizes 32,128]

Unlike `bench one-batch`, which runs the model runner step by step and waits for each step,
this goes through `Engine.generate` and its scheduler, with and without overlap scheduling
(host work of step N+1, FlashInfer's planning included, runs while step N is on the GPU).
Model: DeepSeek-V3 shapes, dummy FP8 weights, --num-layers layers, one GPU. Every request
has a random prompt of --input-len tokens and generates --output-len tokens (ignore_eos), all
submitted at once; the figure is output tokens per second of wall time, prefill included.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def run(attn: str, overlap: bool, bs: int, opts) -> dict:
    eng = Engine(model="deepseek-v3", load_format="dummy", num_layers=opts.num_layers, attention_backend=attn,
                 disable_overlap_schedule=not overlap, max_running_requests=bs, cuda_graph_bs=str(bs),
                 max_model_len=opts.input_len + opts.output_len + 8)
    g = torch.Generator().manual_seed(0)
    warm, prompts = ([torch.randint(10, 1000, (opts.input_len,), generator=g).tolist() for _ in range(bs)]
                     for _ in range(2))
    sp = SamplingParams(max_new_tokens=opts.output_len, temperature=0, ignore_eos=True)
    # Warm-up at the full batch on other prompts (no prefix-cache hits later): kernel compiles, autotuning.
    eng.generate(input_ids=warm, sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate(input_ids=prompts, sampling_params=sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in out)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return {"attn": attn, "overlap": overlap, "bs": bs, "wall_s": wall, "out_tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention-backends", default="triton,flashinfer")
    ap.add_argument("--batch-sizes", default="32,128")
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    opts = ap.parse_args()
    rows = []
    for bs in map(int, opts.batch_sizes.split(",")):
        for attn in opts.attention_backends.split(","):
            for overlap in (False, True):
                rows.append(run(attn, overlap, bs, opts))
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(opts.out, "bench_offline_throughput.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, DeepSeek-V3 dummy FP8, {opts.num_layers} layers, "
          f"in {opts.input_len} / out {opts.output_len}, CUDA graphs; output tok/s (prefill included):")
    base = {(r["bs"], r["overlap"]): r["out_tok_s"] for r in rows if r["attn"] == "triton"}
    for r in rows:
        rel = r["out_tok_s"] / base[(r["bs"], r["overlap"])] if (r["bs"], r["overlap"]) in base else float("nan")
        print(f"  bs {r['bs']:>4}  {r['attn']:10} overlap {'on ' if r['overlap'] else 'off'}  "
              f"{r['out_tok_s']:9.0f} tok/s  ({rel:.2f}x triton)")


if __name__ == "__main__":
    main()
