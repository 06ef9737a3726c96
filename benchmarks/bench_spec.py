"""Speculative decoding (NextN / MTP, EAGLE-2 tree) on one GPU: step cost and tok/s, spec on vs off.

    python benchmarks/bench_spec.py --model deepseek-v3 --load-format dummy --num-layers 5
    python benchmarks/bench_spec.py --model tiny --tok-s-only --batch-size 1 8 32

Part 1 (skipped with --tok-s-only), per batch size: one engine with speculation on; `bs` requests of
--input-len random tokens are prefilled, then the median of --steps scheduler steps is taken twice:
with the spec step (draft extend + draft tree + one verify forward + accept) and with the plain
decode step (same engine, spec detached: CUDA graphs as configured). A spec step that emits L tokens
per request on average runs at L * t_decode / t_spec times plain decode speed; the table gives that
at L = 2.0 / 2.5 / 3.0 (dummy weights have a random MTP layer, so the measured acceptance is
meaningless there; the cost of a step does not depend on it).
Part 2: output tok/s of `generate` (bs prompts, --output-len greedy tokens) with spec on and off (the
same engine, spec step detached), and the accepted length measured (meaningful with real or trained
weights). The tables print last. One engine in one process: compare numbers of the same run only.
"""

from __future__ import annotations

import argparse
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


def _median_step(eng, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        eng.scheduler.step()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:] if len(times) > 1 else times)


def step_costs(eng, bs: int, input_len: int, steps: int) -> tuple[float, float]:
    """(median spec step, median plain decode step) in seconds at batch bs."""
    spec = eng.scheduler.spec
    out = []
    for use_spec in (True, False):
        eng.scheduler = eng.make_scheduler(disable_radix_cache=True)
        if not use_spec:
            eng.scheduler.spec = None
        p = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
        reqs = [eng.make_request(ids, p) for ids in _prompts(bs, input_len, eng.config.vocab_size)]
        for r in reqs:
            eng.scheduler.add(r)
        while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
            eng.scheduler.step()  # prefill (and some decode steps in between)
        out.append(_median_step(eng, steps))
        eng.scheduler.abort_all()
        eng.scheduler.flush()
        eng.scheduler.take_outputs()
    eng.scheduler.spec = spec
    return out[0], out[1]


def tok_s(eng, bs: int, input_len: int, output_len: int, spec: bool) -> float:
    """Output tok/s of one generate call (spec False: the same engine with the spec step detached)."""
    decoder = eng.scheduler.spec
    eng.scheduler = eng.make_scheduler()
    eng.scheduler.spec = decoder if spec else None
    p = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    ps = _prompts(bs, input_len, eng.config.vocab_size, seed=1)
    eng.generate(input_ids=ps[:1], sampling_params=SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
    if spec:
        decoder.stats = SpecStats(decoder.steps + 1)
    _sync()
    t = time.perf_counter()
    outs = eng.generate(input_ids=ps, sampling_params=p)
    _sync()
    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
    eng.scheduler.spec = decoder
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--spec-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--tok-s-only", action="store_true")
    a = ap.parse_args()
    flags = dict(model=a.model, load_format=a.load_format, num_layers=a.num_layers,
                 max_running_requests=max(a.batch_size), max_model_len=a.input_len + a.output_len + 64 * a.steps,
                 chunked_prefill_size=8192, max_prefill_tokens=16384)
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=a.spec_steps, speculative_eagle_topk=a.topk,
                speculative_num_draft_tokens=a.draft_tokens)
    on = Engine(**flags, **spec)
    rows = []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if not a.tok_s_only:
        for bs in a.batch_size:
            t_spec, t_dec = step_costs(on, bs, a.input_len, a.steps)
            rows.append(f"{bs:>5} {t_dec * 1e3:>10.2f} {t_spec * 1e3:>10.2f} {t_spec / t_dec:>7.2f} " +
                        " ".join(f"{L * t_dec / t_spec:>6.2f}x" for L in LENGTHS))
    tok = []
    for bs in a.batch_size:
        spec_tok = tok_s(on, bs, a.input_len, a.output_len, spec=True)
        accept = on.scheduler.spec.stats.mean
        tok.append((bs, spec_tok, accept, tok_s(on, bs, a.input_len, a.output_len, spec=False)))
    print(f"\n{a.model} ({a.load_format}, {a.num_layers} layers + MTP) on {device}; tree {a.spec_steps} steps x "
          f"top-{a.topk}, {a.draft_tokens} nodes; input {a.input_len}")
    if rows:
        print("\none step: plain decode vs draft + verify (ms), and the speed-up at accepted length L")
        print(f"{'batch':>5} {'decode ms':>10} {'spec ms':>10} {'ratio':>7} " +
              " ".join(f"L={L:<4}" for L in LENGTHS))
        print("\n".join(rows))
    print(f"\noutput tok/s (prefill included), {a.output_len} tokens per request")
    print(f"{'batch':>5} {'spec off':>10} {'spec on':>10} {'speed-up':>9} {'accepted':>9}")
    for bs, s, acc, o in tok:
        print(f"{bs:>5} {o:>10.1f} {s:>10.1f} {s / o:>8.2f}x {acc:>9.2f}")


if __name__ == "__main__":
    main()
