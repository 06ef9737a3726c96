"""Host overhead of one decode step: scheduler + output processing, with a fake forward (no model), on CPU.

    python benchmarks/bench_host_overhead.py [--requests 256] [--context 4096] [--steps 200] [--stop]

`--requests` requests with random `--context`-token prompts are prefilled through the real
`Scheduler` (radix cache, overlap scheduling and output processor as `dsctl serve` runs them),
then every measured step decodes all of them. The forward is a stand-in that returns fixed
logits over a small vocabulary, so what is timed is the host work that grows with the batch
and the context: choosing the batch, KV slot bookkeeping, building the forward batch, sampling
bookkeeping, appending tokens, stop checks, the per-request deltas (`take_outputs`) and the
engine loop's stats. The figure printed is the mean and median wall time of
`step() + take_outputs() + stats()`, minus the fake forward's own time.

`--stop` gives every request two stop strings (they never match), so each token is also
detokenized for the incremental stop-string check (uses the built-in tiny model's tokenizer).
`--churn N` gives requests staggered lengths so that about N requests finish per step and as
many new ones are admitted (prefill steps then alternate with decode steps; both are timed).
`--waiting N` queues N more requests that the KV pool cannot hold (the request table could), so
every step also tries, and fails, to admit one. `--mixed` turns mixed batches on (--enable-mixed-chunk:
the decodes run inside the prefill steps instead of alternating with them). The run also reports the
garbage collector's generation-2 (full) collections over the whole run (the prefill of the requests
included: a burst of arrivals), the longest one, and what one forced after the prefill takes; `--freeze-heap` first freezes the heap alive
before any request (imports, the scheduler) out of collections, as `dsctl serve`'s processes do at the
end of start-up (engine/runtime/heap.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.args import SchedulerArgs  # noqa: E402
from engine.memory.pools import KVPool, ReqToTokenPool  # noqa: E402
from engine.runtime.heap import freeze_startup_heap, on_collections  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.scheduler.processor import OutputProcessor  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402

VOCAB = 64  # small, so that the (synchronous, on CPU) sampling maths is negligible beside the host work


@dataclass
class _Config:
    vocab_size: int


@dataclass
class _Out:
    logits: torch.Tensor


class FakeRunner:
    """What the scheduler reads of a ModelRunner; `forward` returns fixed logits and times itself."""

    def __init__(self, max_running: int, max_model_len: int, kv_tokens: int):
        self.device = torch.device("cpu")
        self.config = _Config(VOCAB)
        self.max_model_len = max_model_len
        self.max_running_requests = max_running
        self.kv_pool = KVPool(1, kv_tokens, 1, torch.float32, self.device)
        self.req_to_token = ReqToTokenPool(max_running, max_model_len + 1, self.device)
        g = torch.Generator().manual_seed(0)
        self._logits = torch.randn(max(max_running, 1), VOCAB, generator=g)
        self.forward_s = 0.0

    def forward(self, fb) -> _Out:
        t = time.perf_counter()
        n = int(fb.logits_indices.numel())
        rows = self._logits[:n] if n <= self._logits.shape[0] else self._logits[torch.arange(n) % len(self._logits)]
        out = _Out(rows.clone())
        self.forward_s += time.perf_counter() - t
        return out

    def share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens  # one process: nothing to share


def _tokenizer(stop: bool):
    if not stop:
        return None
    from engine.args import ModelArgs
    from engine.checkpoint.resolve import resolve_model
    from engine.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(ModelArgs(model="tiny")).tokenizer_path)


def _params(opts, i: int) -> SamplingParams:
    """With --churn N, the first requests end N per step after the warm-up and later ones live requests/N steps."""
    new = opts.max_new
    if opts.churn:
        new = opts.warmup + 1 + i // opts.churn if i < opts.requests else max(1, opts.requests // opts.churn)
    stop = ["<never-here>", "\x00\x01"] if opts.stop else []
    return SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True, stop=stop)


def _timed_step(sched: Scheduler, runner: FakeRunner) -> float:
    f0 = runner.forward_s
    t = time.perf_counter()
    sched.step()
    sched.take_outputs()
    sched.stats()
    return time.perf_counter() - t - (runner.forward_s - f0)


def run(opts) -> dict:
    max_len = opts.context + opts.max_new + 8
    table = opts.requests + opts.waiting
    runner = FakeRunner(table, max_len, opts.requests * (opts.context + opts.max_new) + 16)
    outputs = OutputProcessor(_tokenizer(opts.stop), set(), max_len)
    args = SchedulerArgs(max_running_requests=table, max_prefill_tokens=opts.context * 8, chunked_prefill_size=-1,
                         enable_mixed_chunk=opts.mixed)
    sched = Scheduler(runner, outputs, args, radix_cache=True)
    g = torch.Generator().manual_seed(1)
    serial = iter(range(10**9))

    def new_request() -> Request:
        i = next(serial)
        ids = torch.randint(0, VOCAB, (opts.context,), generator=g).tolist()
        return Request.new(str(i), ids, _params(opts, i))

    for _ in range(opts.requests):
        sched.add(new_request())
    t = time.perf_counter()
    while sched.waiting or sched.prefilling is not None:
        sched.step()
        sched.take_outputs()
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    gc.collect()  # what one full collection costs now (all of the heap, or what the requests added to a frozen one)
    full_collection_s = time.perf_counter() - t
    for _ in range(opts.waiting):
        sched.add(new_request())
    if opts.waiting:  # reserve every token the running requests may still generate: the pool has no room left
        sched.reservation.ratio = 1.0
        sched.reservation.decode_step = lambda: None
    for _ in range(opts.warmup):
        sched.step()
        sched.take_outputs()
    times, decode_steps0 = [], sched.stats()["decode_steps"]
    for _ in range(opts.steps):
        times.append(_timed_step(sched, runner))
        if opts.churn:
            for _ in range(opts.requests - len(sched.running) - len(sched.waiting)):
                sched.add(new_request())
    stats = sched.stats()
    ms = [x * 1e3 for x in times]
    return {"requests": opts.requests, "context": opts.context, "stop": opts.stop, "churn": opts.churn,
            "waiting": len(sched.waiting),
            "running_at_end": len(sched.running), "decode_steps": stats["decode_steps"] - decode_steps0,
            "steps": len(ms), "mean_ms": statistics.fmean(ms), "median_ms": statistics.median(ms),
            "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))], "max_ms": max(ms), "setup_prefill_s": prefill_s,
            "forced_full_collection_ms": full_collection_s * 1e3}


@contextlib.contextmanager
def _full_collections():
    """The seconds of every generation-2 collection while the block runs."""
    seconds: list[float] = []

    def report(generation: int, took: float, _info: dict) -> None:
        if generation == 2:
            seconds.append(took)

    hook = on_collections(report)
    try:
        yield seconds
    finally:
        gc.callbacks.remove(hook)


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=200, help="measured steps")
    ap.add_argument("--warmup", type=int, default=20, help="unmeasured decode steps first")
    ap.add_argument("--max-new", type=int, default=1024, help="max_new_tokens (requests never finish early)")
    ap.add_argument("--stop", action="store_true", help="two (never matching) stop strings per request")
    ap.add_argument("--churn", type=int, default=0, help="about this many requests finish (and start) per step")
    ap.add_argument("--waiting", type=int, default=0, help="requests queued that the KV pool cannot hold")
    ap.add_argument("--mixed", action="store_true", help="mixed batches: decodes inside prefill steps (with --churn)")
    ap.add_argument("--freeze-heap", action="store_true", help="freeze the heap out of garbage collection first")
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)  # host work is single-threaded; extra threads only add noise here
    if opts.freeze_heap:
        freeze_startup_heap("bench")
    try:
        with _full_collections() as full:
            res = run(opts)
    finally:
        if opts.freeze_heap:
            gc.unfreeze()
    res.update(full_collections=len(full), longest_full_collection_ms=max(full, default=0.0) * 1e3)
    print(f"{res['requests']} requests x {res['context']} context, stop strings {'on' if res['stop'] else 'off'}"
          f"{', churn ' + str(res['churn']) + '/step' if res['churn'] else ''}"
          f"{', ' + str(res['waiting']) + ' waiting' if res['waiting'] else ''}"
          f"{', mixed batches' if opts.mixed else ''}: "
          f"{res['mean_ms']:.3f} ms/step mean, {res['median_ms']:.3f} median, {res['p90_ms']:.3f} p90 "
          f"over {res['steps']} steps ({res['decode_steps']} decode steps; scheduler + output processing, "
          f"fake forward excluded; the longest {res['max_ms']:.1f} ms); {res['full_collections']} full garbage "
          f"collections in the whole run (prefill included), the longest {res['longest_full_collection_ms']:.1f} ms; "
          f"one forced after the prefill {res['forced_full_collection_ms']:.1f} ms"
          f"{' (the start-up heap frozen first)' if opts.freeze_heap else ''}")
    return res


if __name__ == "__main__":
    main()
