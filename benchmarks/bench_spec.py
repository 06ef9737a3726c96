"""Speculative decoding (NextN / MTP, EAGLE-2 tree) on one GPU: step cost and tok/s, spec on vs off.

    python benchmarks/bench_spec.py --model deepseek-v3 --num-layers 3 --json /tmp/l3.json
    python benchmarks/bench_spec.py --model deepseek-v3 --num-layers 5 --project /tmp/l3.json
    python benchmarks/bench_spec.py --model tiny-py --load-format auto --tok-s-only --batch-size 1 8 32

Part 1 (skipped with --tok-s-only), per batch size and draft tree (--trees steps,topk,nodes): `bs`
requests of --input-len random tokens are prefilled, then the median of --steps scheduler steps is
taken with the spec step (draft KV extend + draft tree + one verify forward + accept, CUDA graphs as
configured) and, on the same engine with speculation detached, with the plain decode step. A spec step
that emits L tokens per request on average runs at L * t_decode / t_spec times plain decode speed; the
table gives that at L = 2.0 / 2.5 / 3.0 (dummy weights have a random MTP layer, so their measured
acceptance means nothing; a step's cost does not depend on it).

A 5-layer model pays for the MTP layer (one decoder layer plus the LM head, per draft forward) against
only 5 target layers. --project FILE (this script's --json of the same model at another depth) fits
t = a + b * layers to both step costs per row and prints them at the checkpoint's full depth: a
projection from two measured depths, labelled as such.

Part 2: output tok/s of `generate` (bs prompts, --output-len greedy tokens) with spec on and off (the
same engine, spec step detached; first tree) and the accepted length (meaningful with trained weights).
One engine in one process: compare numbers of the same run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.speculative.stats import SpecStats  # noqa: E402

LENGTHS = (2.0, 2.5, 3.0)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(bs, n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (bs, n), generator=g).tolist()


def _tree_flags(tree) -> dict:
    steps, topk, nodes = tree
    return dict(speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes)


def _median_step(eng, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        _sync()
        t = time.perf_counter()
        eng.scheduler.step()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])  # the first steps after prefill pay one-time work


def step_cost(eng, bs: int, input_len: int, steps: int, tree=None) -> float:
    """Median step time (s) at batch bs: the spec step with `tree`, or plain decode with tree None."""
    eng.scheduler = eng.make_scheduler(disable_radix_cache=True, **(_tree_flags(tree) if tree else {}))
    if tree is None:
        eng.scheduler.spec = None
    p = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    for ids in _prompts(bs, input_len, eng.config.vocab_size):
        eng.scheduler.add(eng.make_request(ids, p))
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        eng.scheduler.step()  # prefill (and some decode steps in between)
    t = _median_step(eng, steps)
    eng.scheduler.abort_all()
    eng.scheduler.flush()
    eng.scheduler.take_outputs()
    return t


def tok_s(eng, bs: int, input_len: int, output_len: int, tree) -> tuple[float, float]:
    """(output tok/s, accepted length) of one generate call; tree None: the engine with the spec step detached."""
    eng.scheduler = eng.make_scheduler(**(_tree_flags(tree) if tree else {}))
    decoder = eng.scheduler.spec
    if tree is None:
        eng.scheduler.spec = None
    p = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    ps = _prompts(bs, input_len, eng.config.vocab_size, seed=1)
    # an untimed run of the same shapes (other prompts: no radix hits): first-use kernel compilation (Triton
    # specialises on lengths, so a shorter warm-up leaves some of it to the timed run) is not timed
    eng.generate(input_ids=_prompts(bs, input_len, eng.config.vocab_size, seed=2), sampling_params=p)
    if decoder is not None:
        decoder.stats = SpecStats(decoder.steps + 1)
    _sync()
    t = time.perf_counter()
    outs = eng.generate(input_ids=ps, sampling_params=p)
    _sync()
    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
    return rate, (decoder.stats.mean if tree else 1.0)


def _parse_tree(text: str) -> tuple[int, int, int]:
    steps, topk, nodes = (int(x) for x in text.split(","))
    return steps, topk, nodes


def _cost_table(costs: list[dict], title: str) -> list[str]:
    lines = [title, f"{'tree':>8} {'batch':>5} {'decode ms':>10} {'spec ms':>10} {'ratio':>6} " +
             " ".join(f"{'L=' + str(L):>7}" for L in LENGTHS)]
    for c in costs:
        tree = "x".join(map(str, c["tree"]))
        lines.append(f"{tree:>8} {c['bs']:>5} {c['decode_ms']:>10.2f} {c['spec_ms']:>10.2f} "
                     f"{c['spec_ms'] / c['decode_ms']:>6.2f} " +
                     " ".join(f"{L * c['decode_ms'] / c['spec_ms']:>6.2f}x" for L in LENGTHS))
    return lines


def _project(costs: list[dict], other: dict, layers: int, full: int) -> list[dict]:
    """Per row, t = a + b * layers through this run's and `other`'s step costs, evaluated at `full` layers."""
    theirs = {(tuple(c["tree"]), c["bs"]): c for c in other["costs"]}
    out = []
    for c in costs:
        o = theirs.get((tuple(c["tree"]), c["bs"]))
        if o is None or other["num_layers"] == layers:
            continue
        def at_full(key):
            slope = (c[key] - o[key]) / (layers - other["num_layers"])
            return c[key] + slope * (full - layers)
        out.append(dict(tree=c["tree"], bs=c["bs"], decode_ms=at_full("decode_ms"), spec_ms=at_full("spec_ms")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trees", type=_parse_tree, nargs="+", default=[(2, 4, 4), (3, 1, 4), (3, 4, 8)],
                    help="draft trees as steps,topk,nodes (default: the seeds' 2,4,4; a 3-step chain; 3,4,8)")
    ap.add_argument("--cuda-graph-bs", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--enable-torch-compile", action="store_true")
    ap.add_argument("--tok-s-only", action="store_true")
    ap.add_argument("--json", help="write the measured step costs here (for --project)")
    ap.add_argument("--project", help="another depth's --json: project the step costs to full depth")
    a = ap.parse_args()
    widest = max(a.trees, key=lambda t: max(t[1], t[2]))  # the engine reserves rows for the widest tree
    flags = dict(model=a.model, load_format=a.load_format, num_layers=a.num_layers,
                 max_running_requests=max(a.batch_size), max_model_len=a.input_len + a.output_len + 64 * a.steps,
                 chunked_prefill_size=8192, max_prefill_tokens=16384, speculative_algorithm="NEXTN",
                 enable_torch_compile=a.enable_torch_compile, **_tree_flags(widest))
    if torch.cuda.is_available():
        flags["cuda_graph_bs"] = a.cuda_graph_bs
    eng = Engine(**flags)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    costs = []
    if not a.tok_s_only:
        for bs in a.batch_size:
            decode = step_cost(eng, bs, a.input_len, a.steps)
            for tree in a.trees:
                costs.append(dict(tree=list(tree), bs=bs, decode_ms=decode * 1e3,
                                  spec_ms=step_cost(eng, bs, a.input_len, a.steps, tree) * 1e3))
    tok = []
    for bs in a.batch_size:
        on, accepted = tok_s(eng, bs, a.input_len, a.output_len, a.trees[0])
        off, _ = tok_s(eng, bs, a.input_len, a.output_len, None)
        tok.append((bs, off, on, accepted))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, num_layers=a.num_layers, device=device, costs=costs), f)
    full = eng.runner.resolved.config.num_hidden_layers
    print(f"\n{a.model} ({a.load_format}, {a.num_layers} layers + MTP) on {device}; input {a.input_len}; "
          f"trees steps x topk x nodes; CUDA graphs {'on' if torch.cuda.is_available() else 'off'}"
          f"{', torch.compile' if a.enable_torch_compile else ''}")
    if costs:
        print("\n".join(_cost_table(costs, "\none step, measured: plain decode vs draft + verify, and the speed-up "
                                           "at accepted length L")))
    if costs and a.project:
        with open(a.project) as f:
            other = json.load(f)
        print("\n".join(_cost_table(_project(costs, other, a.num_layers, full),
                                    f"\nprojected to {full} layers from the {other['num_layers']}- and "
                                    f"{a.num_layers}-layer measurements (t = a + b * layers)")))
    print(f"\noutput tok/s (prefill included), {a.output_len} tokens per request, tree "
          f"{'x'.join(map(str, a.trees[0]))}")
    print(f"{'batch':>5} {'spec off':>10} {'spec on':>10} {'speed-up':>9} {'accepted':>9}")
    for bs, off, on, acc in tok:
        print(f"{bs:>5} {off:>10.1f} {on:>10.1f} {on / off:>8.2f}x {acc:>9.2f}")


if __name__ == "__main__":
    main()
