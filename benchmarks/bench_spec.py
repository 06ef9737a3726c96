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
acceptance means nothing; a step's cost does not depend on it). The sweep runs --repeats times and each
row keeps its minimum (the spread column: max / min - 1 of decode / spec). --routing same repeats the
sweep with every token routed to the same experts (class Routing): dummy routers send each tree node to
experts of its own, so a verify reads up to nodes x top-k experts where decode reads top-k; real routers
lie between the two.

A 5-layer model pays for the MTP layer (one decoder layer plus the LM head, per draft forward) against
only 5 target layers. --project FILE (this script's --json of the same model at another depth) fits
t = a + b * layers to both step costs per row and prints them at the checkpoint's full depth: a
projection from two measured depths, labelled as such.

Part 2: output tok/s of `generate` (bs prompts, --output-len greedy tokens) with spec on and off (the
same engine, spec step detached; first tree) and the accepted length (meaningful with trained weights).
One engine in one process: compare numbers of the same run only. Each timed call follows an untimed one
of the same shapes, with the radix cache off: the prompts are random ids, and with a small vocabulary
(tiny-py: 264) their first tokens collide with the untimed run's cached prompts, so a cache hit would
shorten the timed prefill by a token or two. That batch of another size needs Triton specialisations the
untimed run did not compile (e.g. the MoE align kernel's token count no longer divisible by 16): about a
second of JIT compilation inside the timed spec-on run (the spec-off run after it reused the kernels).

The breakdown printed above the tok/s table says where each timed call's time went: prefill, decode steps (the
median, 90th percentile and slowest: a one-off cost shows as a slowest step far above the median), the
mean batch of the decode steps (requests that finish early leave stragglers), tokens per decode step,
forwards through a CUDA graph vs eager ones, Triton JIT compiles during the call (CUDA only) and eager
forward shapes the untimed call did not run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.model.moe import MoE  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.speculative.stats import SpecStats  # noqa: E402

LENGTHS = (2.0, 2.5, 3.0)


class Routing:
    """The dummy router of every MoE layer (the MTP layer's too), switched between its random weights
    ("random": each token to k experts of its own, so a verify of n tree nodes reads up to n x k experts
    where decode reads k) and "same" (gate weights zeroed, a fixed random correction bias picks the
    experts: every token to the same k, so a tree's nodes read no expert that decode does not). Real
    routers lie between: consecutive tokens of one text share part of their experts. The parameters are
    written in place, so captured CUDA graphs read the new values."""

    def __init__(self, eng):
        parts = [m for m in (eng.runner.model, eng.runner.mtp) if m is not None]
        self.moes = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
        self.saved = [(m.gate_weight.detach().clone(), None if m.e_score_correction_bias is None
                       else m.e_score_correction_bias.detach().clone()) for m in self.moes]

    def set(self, mode: str) -> None:
        g = torch.Generator().manual_seed(0)
        for m, (weight, bias) in zip(self.moes, self.saved):
            if mode == "random":
                m.gate_weight.data.copy_(weight)
                if bias is not None:
                    m.e_score_correction_bias.data.copy_(bias)
            elif mode == "same":
                m.gate_weight.data.zero_()
                if bias is not None:  # without one, equal scores pick the same (first) experts anyway
                    m.e_score_correction_bias.data.copy_(torch.randn(bias.shape, generator=g))
            else:
                raise ValueError(f"unknown routing {mode!r}")


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
    """Median step time (s) at batch bs: the spec step with `tree` (never disabled by batch size), or plain
    decode with tree None."""
    eng.scheduler = eng.make_scheduler(disable_radix_cache=True, speculative_disable_by_batch_size=None,
                                       **(_tree_flags(tree) if tree else {}))
    if tree is None:
        eng.scheduler.spec = None
    p = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    for ids in _prompts(bs, input_len, eng.config.vocab_size):
        eng.scheduler.add(eng.make_request(ids, p))
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        eng.scheduler.step()  # prefill (and some decode steps in between)
    if len(eng.scheduler.running) < bs:  # the KV pool (--max-total-tokens) admitted fewer: not batch bs
        print(f"warning: step cost at batch {bs} measured with {len(eng.scheduler.running)} requests running",
              file=sys.stderr)
    t = _median_step(eng, steps)
    eng.scheduler.abort_all()
    eng.scheduler.flush()
    eng.scheduler.take_outputs()
    return t


class _Probe:
    """What one generate call did, recorded by wrapping the engine's methods on the instances (nothing
    changes in what runs): scheduler steps (kind, seconds, requests running), forwards through a CUDA graph
    runner (batch rows) or eager (kind, mode, tokens), and Triton kernels JIT-compiled meanwhile (a new
    specialisation: Triton keys int arguments on divisibility by 16 and on == 1, so one more or one less
    token can need a compile)."""

    def __init__(self, eng):
        self.eng = eng
        self.steps: list[tuple[str, float, int]] = []
        self.graph = collections.Counter()  # (kind, rows) through a graph runner
        self.eager = collections.Counter()  # (kind, mode, tokens) eager forwards
        self.compiles: list[str] = []
        self._undo = []

    def _wrap(self, obj, name, make) -> None:
        had = name in vars(obj)
        real = getattr(obj, name)
        setattr(obj, name, make(real))
        self._undo.append(lambda: setattr(obj, name, real) if had else delattr(obj, name))

    def __enter__(self) -> "_Probe":
        r, sched = self.eng.runner, self.eng.scheduler

        def step(real):
            def wrapped():
                st = sched.stats()
                c0 = (st["extend_steps"], st["decode_steps"])
                running = len(sched.running)
                t = time.perf_counter()
                real()
                dt = time.perf_counter() - t
                st = sched.stats()
                c1 = (st["extend_steps"], st["decode_steps"])
                kind = "extend" if c1[0] > c0[0] else "decode" if c1[1] > c0[1] else "idle"
                self.steps.append((kind, dt, running))
            return wrapped

        def replay(kind):
            def make(real):
                def wrapped(fb, bs=None):
                    self.graph[(kind, fb.batch_size)] += 1
                    return real(fb, bs)
                return wrapped
            return make

        def eager(kind):
            def make(real):
                def wrapped(fb):
                    self.eager[(kind, fb.mode.name, fb.num_tokens)] += 1
                    return real(fb)
                return wrapped
            return make

        def scratch(real):
            def wrapped(lists):
                rows = real(lists)
                if rows is None:  # forward_tree runs this tree batch eagerly
                    self.eager[("tree", "DECODE", lists.shape[0])] += 1
                return rows
            return wrapped

        self._wrap(sched, "step", step)
        # The eager forwards of the runner and its draft have no public hook: a benchmark-only wrap of both.
        self._wrap(r, "_forward_eager", eager("target"))
        self._wrap(r.draft, "_forward_eager", eager("mtp"))
        self._wrap(r.req_to_token, "write_scratch", scratch)
        for kind, g in (("target", r.graphs), ("mtp", r.draft.graphs)):
            if g is not None:
                self._wrap(g, "replay", replay(kind))
        self._hook_triton()
        return self

    def _hook_triton(self) -> None:
        """Count Triton's in-process cache misses (a compile, or a load from its disk cache): CUDA only (the
        CPU interpreter compiles nothing)."""
        if not torch.cuda.is_available():
            return
        try:
            from triton import knobs
            holder, attr = knobs.runtime, "jit_cache_hook"
        except ImportError:  # Triton before 3.4
            try:
                from triton.runtime.jit import JITFunction
            except ImportError:
                return
            holder, attr = JITFunction, "cache_hook"
        prev = getattr(holder, attr, None)

        def hook(*args, **kw):
            fn = kw.get("fn")
            self.compiles.append(getattr(fn, "name", None) or str(kw.get("repr", "?"))[:60])
            return prev(*args, **kw) if prev is not None else False  # truthy would skip the compile

        setattr(holder, attr, hook)
        self._undo.append(lambda: setattr(holder, attr, prev))

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def summary(self, tokens: int, seconds: float) -> dict:
        dec = [(dt, n) for kind, dt, n in self.steps if kind == "decode"]
        times = sorted(dt for dt, _ in dec) or [0.0]
        return dict(seconds=seconds, tokens=tokens,
                    prefill_s=sum(dt for kind, dt, _ in self.steps if kind == "extend"),
                    extend_steps=sum(kind == "extend" for kind, _, _ in self.steps), decode_steps=len(dec),
                    decode_s=sum(times), median_s=statistics.median(times),
                    p90_s=times[min(len(times) - 1, int(0.9 * len(times)))], max_s=times[-1],
                    mean_batch=sum(n for _, n in dec) / len(dec) if dec else 0.0,
                    graph=sum(self.graph.values()), eager=sum(self.eager.values()),
                    compiles=list(self.compiles) if torch.cuda.is_available() else None)


def tok_s(eng, bs: int, input_len: int, output_len: int, tree) -> dict:
    """One timed generate call (tree None: the engine with the spec step detached): its output tok/s
    (`rate`), accepted length, and where its time went (`timed`, `_Probe.summary`); `new_shapes`: eager
    forward shapes that the untimed call before it did not run (each may need kernels compiled; decode-mode
    ones only with CUDA graphs, without which every decode forward is eager at its own size)."""
    # radix cache off: a hit on the untimed run's prompts would change the timed prefill's shapes (docstring)
    eng.scheduler = eng.make_scheduler(disable_radix_cache=True, **(_tree_flags(tree) if tree else {}))
    decoder = eng.scheduler.spec
    if tree is None:
        eng.scheduler.spec = None
    p = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    ps = _prompts(bs, input_len, eng.config.vocab_size, seed=1)
    # an untimed run of the same shapes (other prompts): first-use kernel compilation (Triton specialises on
    # lengths, so a shorter warm-up leaves some of it to the timed run) is not timed
    with _Probe(eng) as warm:
        eng.generate(input_ids=_prompts(bs, input_len, eng.config.vocab_size, seed=2), sampling_params=p)
    if decoder is not None:
        decoder.stats = SpecStats(decoder.steps + 1)
    hits = eng.scheduler.stats()["prefix_cache_hit_tokens"]
    with _Probe(eng) as probe:
        _sync()
        t = time.perf_counter()
        outs = eng.generate(input_ids=ps, sampling_params=p)
        _sync()
        elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    graphs = eng.runner.graphs is not None  # without graphs every decode forward is eager: its sizes vary
    # nan: no step speculated (every step plain, --disable-by-batch-size)
    accepted = 1.0 if tree is None else decoder.stats.mean if decoder.stats.steps else float("nan")
    return dict(rate=tokens / elapsed, accepted=accepted,
                timed=probe.summary(tokens, elapsed),
                hit_tokens=eng.scheduler.stats()["prefix_cache_hit_tokens"] - hits,
                new_shapes=sorted(k for k in set(probe.eager) - set(warm.eager) if k[1] != "DECODE" or graphs))


def _breakdown(rows: list[tuple[int, str, dict]]) -> list[str]:
    lines = ["\nthe timed generate calls: where the time went (steps in ms; one-off work, e.g. a JIT compile, "
             "shows as a max far above the median)",
             f"{'batch':>5} {'spec':>4} {'total':>8} {'prefill':>8} {'steps':>5} {'batch~':>6} {'tok/step':>8} "
             f"{'median':>7} {'p90':>7} {'max':>7} {'ms/step':>7} {'graph':>6} {'eager':>6} {'JIT':>4} {'hits':>4}"]
    for bs, spec, r in rows:
        t = r["timed"]
        jit = "-" if t["compiles"] is None else str(len(t["compiles"]))
        per_step = t["decode_s"] / t["decode_steps"] if t["decode_steps"] else 0.0
        lines.append(f"{bs:>5} {spec:>4} {t['seconds'] * 1e3:>8.1f} {t['prefill_s'] * 1e3:>8.1f} "
                     f"{t['decode_steps']:>5} {t['mean_batch']:>6.1f} "
                     f"{t['tokens'] / max(t['decode_steps'], 1):>8.2f} {t['median_s'] * 1e3:>7.2f} "
                     f"{t['p90_s'] * 1e3:>7.2f} {t['max_s'] * 1e3:>7.2f} {per_step * 1e3:>7.2f} {t['graph']:>6} "
                     f"{t['eager']:>6} {jit:>4} {r['hit_tokens']:>4}")
    for bs, spec, r in rows:
        if r["timed"]["compiles"]:
            lines.append(f"batch {bs} spec {spec}: Triton compiled {', '.join(r['timed']['compiles'])}")
        if r["new_shapes"]:
            lines.append(f"batch {bs} spec {spec}: eager forwards the untimed call did not run: "
                         + ", ".join(f"{k} {m} {n}" for k, m, n in r["new_shapes"]))
    return lines


def measure_costs(eng, routing: Routing, a) -> list[dict]:
    """Step costs per routing, batch size and tree: the whole sweep --repeats times, each row's minimum over
    the repeats (the spread, max / min - 1, says how much the repeats differed)."""
    runs: dict[tuple, list[tuple[float, float]]] = {}
    for _ in range(a.repeats):
        for mode in a.routing:
            routing.set(mode)
            for bs in a.batch_size:
                decode = step_cost(eng, bs, a.input_len, a.steps)
                for tree in a.trees:
                    spec = step_cost(eng, bs, a.input_len, a.steps, tree)
                    runs.setdefault((mode, tuple(tree), bs), []).append((decode, spec))
    costs = []
    for (mode, tree, bs), times in runs.items():
        d, s = [t[0] for t in times], [t[1] for t in times]
        costs.append(dict(routing=mode, tree=list(tree), bs=bs, decode_ms=min(d) * 1e3, spec_ms=min(s) * 1e3,
                          decode_spread=max(d) / min(d) - 1, spec_spread=max(s) / min(s) - 1))
    return costs


def _parse_tree(text: str) -> tuple[int, int, int]:
    steps, topk, nodes = (int(x) for x in text.split(","))
    return steps, topk, nodes


def _cost_table(costs: list[dict], title: str) -> list[str]:
    lines = [title, f"{'routing':>7} {'tree':>8} {'batch':>5} {'decode ms':>10} {'spec ms':>10} {'ratio':>6} " +
             " ".join(f"{'L=' + str(L):>7}" for L in LENGTHS) + f" {'spread':>11}"]
    for c in costs:
        tree = "x".join(map(str, c["tree"]))
        spread = (f"{c['decode_spread']:>5.0%}/{c['spec_spread']:<5.0%}" if "decode_spread" in c else "")
        lines.append(f"{c.get('routing', 'random'):>7} {tree:>8} {c['bs']:>5} {c['decode_ms']:>10.2f} "
                     f"{c['spec_ms']:>10.2f} {c['spec_ms'] / c['decode_ms']:>6.2f} " +
                     " ".join(f"{L * c['decode_ms'] / c['spec_ms']:>6.2f}x" for L in LENGTHS) + f" {spread:>11}")
    return lines


def _project(costs: list[dict], other: dict, layers: int, full: int) -> list[dict]:
    """Per row, t = a + b * layers through this run's and `other`'s step costs, evaluated at `full` layers."""
    def key(c):
        return c.get("routing", "random"), tuple(c["tree"]), c["bs"]

    theirs = {key(c): c for c in other["costs"]}
    out = []
    for c in costs:
        o = theirs.get(key(c))
        if o is None or other["num_layers"] == layers:
            continue
        def at_full(key):
            slope = (c[key] - o[key]) / (layers - other["num_layers"])
            return c[key] + slope * (full - layers)
        out.append(dict(routing=c.get("routing", "random"), tree=c["tree"], bs=c["bs"], decode_ms=at_full("decode_ms"),
                        spec_ms=at_full("spec_ms")))
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
    ap.add_argument("--cost-only", action="store_true", help="skip the tok/s part")
    ap.add_argument("--tok-s-batch-size", type=int, nargs="+", help="batch sizes of the tok/s part (default: --batch-size)")
    ap.add_argument("--repeats", type=int, default=2, help="step-cost sweeps; each row keeps its minimum")
    ap.add_argument("--routing", nargs="+", choices=("random", "same"), default=["random"],
                    help="dummy routers for the step costs (class Routing): random (dummy weights as loaded) and/or "
                         "same (every token to the same experts); the tok/s part uses the first")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="--speculative-disable-by-batch-size for the spec-on tok/s runs (plain steps from this batch)")
    ap.add_argument("--json", help="write the measured step costs here (for --project)")
    ap.add_argument("--project", help="another depth's --json: project the step costs to full depth")
    a = ap.parse_args()
    widest = max(a.trees, key=lambda t: max(t[1], t[2]))  # the engine reserves rows for the widest tree
    flags = dict(model=a.model, load_format=a.load_format, num_layers=a.num_layers,
                 max_running_requests=max(a.batch_size + (a.tok_s_batch_size or [])), max_model_len=a.input_len + a.output_len + 64 * a.steps,
                 chunked_prefill_size=8192, max_prefill_tokens=16384, speculative_algorithm="NEXTN",
                 enable_torch_compile=a.enable_torch_compile, **_tree_flags(widest),
                 speculative_disable_by_batch_size=a.disable_by_batch_size)
    if torch.cuda.is_available():
        flags["cuda_graph_bs"] = a.cuda_graph_bs
    eng = Engine(**flags)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    routing = Routing(eng)
    costs = [] if a.tok_s_only else measure_costs(eng, routing, a)
    routing.set(a.routing[0])
    tok, runs = [], []
    for bs in ([] if a.cost_only else a.tok_s_batch_size or a.batch_size):
        on = tok_s(eng, bs, a.input_len, a.output_len, a.trees[0])
        off = tok_s(eng, bs, a.input_len, a.output_len, None)
        tok.append((bs, off["rate"], on["rate"], on["accepted"]))
        runs += [(bs, "on", on), (bs, "off", off)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, num_layers=a.num_layers, device=device, costs=costs), f)
    full = eng.runner.resolved.config.num_hidden_layers
    print(f"\n{a.model} ({a.load_format}, {a.num_layers} layers + MTP) on {device}; input {a.input_len}; "
          f"trees steps x topk x nodes; CUDA graphs {'on' if torch.cuda.is_available() else 'off'}"
          f"{', torch.compile' if a.enable_torch_compile else ''}"
          f"{f', spec off from batch {a.disable_by_batch_size}' if a.disable_by_batch_size else ''}"
          f"; routing {', '.join(a.routing)}")
    if costs:
        print("\n".join(_cost_table(costs, "\none step, measured: plain decode vs draft + verify, and the speed-up "
                                           "at accepted length L")))
    if costs and a.project:
        with open(a.project) as f:
            other = json.load(f)
        print("\n".join(_cost_table(_project(costs, other, a.num_layers, full),
                                    f"\nprojected to {full} layers from the {other['num_layers']}- and "
                                    f"{a.num_layers}-layer measurements (t = a + b * layers)")))
    if a.cost_only:
        return
    print("\n".join(_breakdown(runs)))  # before the tok/s table, which stays the output's last lines
    print(f"\noutput tok/s (prefill included), {a.output_len} tokens per request, tree "
          f"{'x'.join(map(str, a.trees[0]))}")
    print(f"{'batch':>5} {'spec off':>10} {'spec on':>10} {'speed-up':>9} {'accepted':>9}")
    for bs, off, on, acc in tok:
        print(f"{bs:>5} {off:>10.1f} {on:>10.1f} {on / off:>8.2f}x " + (f"{acc:>9.2f}" if acc == acc else f"{'-':>9}"))


if __name__ == "__main__":
    main()
