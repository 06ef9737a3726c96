"""Greedy tokens of several parallel layouts against one rank, on the same dummy weights and prompts.

    python3 benchmarks/multi_gpu_check.py --model deepseek-v2-lite [--num-layers 0] [--prompts 16]
        [--max-new-tokens 32] [--layouts tp1,tp2,tp2-dp2,tp2-ep2] [--modes eager,graph,graph+compile]
        [--device cuda] [--dtype auto] [--result-file F.jsonl]

Every (layout, mode) runs as its own engine ranks (engine.runtime.offline.RankedEngine, the processes `dsctl
serve` starts; tp1 too, so each run frees its GPUs when it ends). Dummy weights are a rank's slice
of the TP-1 values (engine/weights/dummy.py), so every layout computes the same model. Prompts are
random token ids of varied lengths, a third of them sharing a prefix (radix cache hits), all in one
batch; greedy, from a quarter of `--max-new-tokens` to all of it (so the decode batch shrinks
through every graph size), with log-probs and the top 5 alternatives.

Modes: eager (--disable-cuda-graph), graph (CUDA graphs of sizes 1, 4, 16, smaller batches padded),
graph+compile (the same with --enable-torch-compile). `--num-layers fit`: the deepest truncation of
the model that every layout's ranks hold on this machine's GPUs (the memory plan of engine/memory/plan.py
for these flags, as the launch check makes it, with a KV pool of 64k tokens), e.g. DeepSeek-V3 on two GPUs.
The reference is the first layout in eager mode (tp1 by default).

In bf16 a different TP split or DP batch changes the order of floating-point sums, so a run may
pick another token where the reference's two best tokens are nearly tied. For every prompt that
diverges the table gives the reference's log-prob gap between its token and the run's token at the
first divergence (from the reference's top-5; "> x" when the run's token is not among them), and for
every run the largest log-prob difference of the chosen tokens before any divergence. A run passes
when each divergence is at a gap below --tie-gap; the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layouts import engine_flags  # noqa: E402

MODES = ("eager", "graph", "graph+compile")
GRAPH_SIZES = "1,4,16"  # captured (and compiled) decode sizes: the shrinking batch pads to each
LARGEST_GRAPH_SIZE = max(map(int, GRAPH_SIZES.split(",")))  # the default --compile-max-bs: every graph size compiled


def mode_flags(mode: str, compile_max_bs: int = LARGEST_GRAPH_SIZE) -> dict:
    """Engine flags of a mode; graph+compile compiles the graph sizes up to compile_max_bs (each size is
    compiled on its own: the compile time is per size)."""
    if mode == "eager":
        return dict(disable_cuda_graph=True)
    graphs = dict(cuda_graph_bs=GRAPH_SIZES)
    if mode == "graph":
        return graphs
    if mode == "graph+compile":
        return dict(graphs, enable_torch_compile=True, torch_compile_max_bs=compile_max_bs)
    raise SystemExit(f"unknown mode {mode!r} (use {', '.join(MODES)})")


def prompts(vocab: int, n: int, seed: int = 7) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    top = min(vocab, 32000)
    shared = torch.randint(3, top, (48,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(3, top, (8 + (37 * i) % 160,), generator=g).tolist()
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


def new_tokens(n: int, most: int) -> list[int]:
    """Output lengths from most / 4 to most, so that the decode batch shrinks through every graph size."""
    return [max(1, most // 4 + (most - most // 4) * i // max(1, n - 1)) for i in range(n)]


@dataclass
class Run:
    layout: str
    mode: str
    tokens: list = field(default_factory=list)  # per prompt
    logprobs: list = field(default_factory=list)
    top: list = field(default_factory=list)  # per prompt, per position: [(token, logprob), ...]
    seconds: float = 0.0
    failed: list = field(default_factory=list)  # error messages of requests that did not produce every token


def run_layout(base: dict, layout: str, mode: str, ids: list, max_new: int,
               compile_max_bs: int = LARGEST_GRAPH_SIZE) -> Run:
    from engine.args import EngineArgs
    from engine.runtime.offline import RankedEngine
    from engine.sampling import SamplingParams

    args = EngineArgs.of(**base, **engine_flags(layout), **mode_flags(mode, compile_max_bs))
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5)
              for n in new_tokens(len(ids), max_new)]
    t0 = time.perf_counter()
    with RankedEngine(args) as eng:
        outs = eng.generate(input_ids=ids, sampling_params=params)
    failed = [o.error or o.finish_reason for o, p in zip(outs, params) if len(o.token_ids) != p.max_new_tokens]
    return Run(layout, mode, [o.token_ids for o in outs], [o.logprobs or [] for o in outs],
               [[[tuple(p) for p in pos] for pos in (o.top_logprobs or [])] for o in outs], time.perf_counter() - t0,
               failed)


@dataclass
class Compare:
    identical: int  # prompts whose tokens equal the reference's
    prompts: int
    max_dlogprob: float  # largest |log-prob difference| of the chosen tokens before any divergence
    gaps: list  # per diverging prompt: (position, reference's gap to the run's token, or None if beyond top-5)
    worst_top5: float  # reference's gap to its 5th token where a run's token was beyond the top 5


def compare(ref: Run, run: Run) -> Compare:
    identical, dmax, gaps, worst = 0, 0.0, [], 0.0
    for p, (a, b) in enumerate(zip(ref.tokens, run.tokens)):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):  # one stopped early (a failed request): they differ from there
            n = min(len(a), len(b))
        upto = len(a) if n is None else n
        for i in range(upto):
            dmax = max(dmax, abs(ref.logprobs[p][i] - run.logprobs[p][i]))
        if n is None:
            identical += 1
            continue
        if n >= len(a) or n >= len(b):
            gaps.append((n, None))
            continue
        alts = dict(map(tuple, ref.top[p][n]))
        chosen = ref.logprobs[p][n]
        if b[n] in alts:
            gaps.append((n, chosen - alts[b[n]]))
        else:
            gaps.append((n, None))
            worst = max(worst, chosen - min(alts.values(), default=chosen))
    return Compare(identical, len(ref.tokens), dmax, gaps, worst)


def verdict(run: Run, c: Compare, tie_gap: float) -> bool:
    """A run passes when every request produced all its tokens and every divergence is a rounding tie."""
    return not run.failed and all(g is not None and g < tie_gap for _, g in c.gaps)


def print_table(runs: list[Run], ref: Run, tie_gap: float) -> bool:
    print(f"\nreference: {ref.layout} {ref.mode}; gap = reference log-prob of its token minus that of the run's "
          f"token at the first divergence (pass: every gap < {tie_gap})")
    print(f"{'layout':<13} {'mode':<14} {'s':>6} {'identical':>9} {'max |dlp|':>9} {'first divergences (pos: gap)':<40} "
          f"{'ok':>3}")
    ok_all = True
    for r in runs:
        c = compare(ref, r)
        ok = verdict(r, c, tie_gap) and not ref.failed
        ok_all &= ok
        div = ", ".join(f"{n}: {g:.3f}" if g is not None else f"{n}: > {c.worst_top5:.2f}" if c.worst_top5 else
                        f"{n}: ?" for n, g in c.gaps)
        if r.failed:
            div = f"{len(r.failed)} request(s) failed: {r.failed[0][:60]}"
        print(f"{r.layout:<13} {r.mode:<14} {r.seconds:6.1f} {c.identical:>4}/{c.prompts:<4} {c.max_dlogprob:9.4f} "
              f"{div or '-':<40} {'yes' if ok else 'NO':>3}")
    return ok_all


def fit_layers(base: dict, layouts: list[str], gpu_bytes: float, min_kv_tokens: int = 65536,
               spare_layers: int = 1) -> int:
    """The deepest truncation of the model of `base` (the runs' engine flags: dummy weights, FP8 where its
    checkpoint is) at which the memory plan (engine/memory/plan.py, from the flags as the launch check reads them)
    gives every layout's ranks a KV pool of `min_kv_tokens` on GPUs of `gpu_bytes` (CUDA's total), less
    `spare_layers` for what the plan does not count (CUDA graphs, the MoE workspace)."""
    from engine.args import EngineArgs
    from engine.checkpoint.resolve import resolve_model
    from engine.memory.plan import plan_memory
    from engine.runtime.launch_checks import plan_spec

    runs = [EngineArgs.of(**base, **engine_flags(name)) for name in layouts]
    resolved = resolve_model(runs[0].model)

    def fits(n: int) -> bool:
        return all(plan_memory(plan_spec(a.replace(num_layers=n), resolved, a.parallel.config(), gpu_bytes))
                   .memory_tokens >= min_kv_tokens for a in runs)

    n = resolved.config.num_hidden_layers
    while n > 1 and not fits(n):
        n -= 1
    return max(1, n - spare_layers)


def stored_run(row: dict) -> Run:
    """A Run from one --result-file line (files without "top" give divergence gaps as unknown)."""
    return Run(row["layout"], row["mode"], row["tokens"], row["logprobs"], row.get("top") or
               [[[] for _ in t] for t in row["tokens"]], row["seconds"], row.get("failed", []))


def _value(text: str):
    """An --engine-flag value: JSON (numbers, true / false) where it parses, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--num-layers", default="0", help="0: the model's full depth; fit: the deepest that fits")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layouts", default="tp1,tp2,tp2-dp2,tp2-ep2")
    p.add_argument("--modes", default="eager,graph,graph+compile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tie-gap", type=float, default=0.05,
                   help="largest reference log-prob gap at which a divergence counts as a rounding tie")
    p.add_argument("--engine-flag", action="append", default=[], metavar="NAME=VALUE",
                   help="another engine flag for every run (field name, e.g. attention_backend=torch)")
    p.add_argument("--compile-max-bs", type=int, default=LARGEST_GRAPH_SIZE,
                   help="graph+compile: compile the graph sizes up to this (default: all of " + GRAPH_SIZES + ")")
    p.add_argument("--tag", default="", help="a label appended to each run's layout in the table and the result "
                   "file (e.g. the --engine-flag that sets this run apart from the reference)")
    p.add_argument("--result-file", default=None)
    p.add_argument("--from-jsonl", default=None, metavar="FILE",
                   help="no runs: print the table of the runs stored in FILE (a --result-file), first run = reference")
    a = p.parse_args(argv)
    if a.from_jsonl:
        runs = [stored_run(json.loads(line)) for line in open(a.from_jsonl)]
        return 0 if print_table(runs, runs[0], a.tie_gap) else 1
    layouts, modes = a.layouts.split(","), a.modes.split(",")
    base = dict(model=a.model, load_format=a.load_format, device=a.device, dtype=a.dtype,
                max_model_len=a.max_model_len)
    for kv in a.engine_flag:
        name, value = kv.split("=", 1)
        base[name] = _value(value)
    if a.num_layers == "fit":
        import torch

        layers = fit_layers(base, layouts, torch.cuda.get_device_properties(0).total_memory)
        print(f"{a.model}: {layers} layers fit every layout of {', '.join(layouts)} on this machine's GPUs")
    else:
        layers = int(a.num_layers)
    base["num_layers"] = layers or None
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    vocab = parse_config(lookup(a.model).config_dict()).vocab_size
    ids = prompts(vocab, a.prompts)
    runs = []
    for mode in modes:
        for layout in layouts:
            run = run_layout(base, layout, mode, ids, a.max_new_tokens, a.compile_max_bs)
            run.layout = f"{layout}:{a.tag}" if a.tag else layout
            print(f"{run.layout} {mode}: {run.seconds:.1f} s" + (f", {len(run.failed)} request(s) failed" if run.failed
                                                              else ""), flush=True)
            runs.append(run)
            if a.result_file:
                with open(a.result_file, "a") as f:
                    f.write(json.dumps({"model": a.model, "dtype": a.dtype, "layout": run.layout, "mode": mode,
                                        "seconds": run.seconds, "tokens": run.tokens, "logprobs": run.logprobs,
                                        "top": run.top, "failed": run.failed}) + "\n")
    ok = print_table(runs, runs[0], a.tie_gap)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
