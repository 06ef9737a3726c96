"""Host work of one speculative decoding step, on CPU, with a stand-in model (no forward compute).

    python benchmarks/bench_spec_host.py [--batch-sizes 1 8 32] [--trees 3,4,8 2,4,4] [--steps 100]

Requests are prefilled through the real `Scheduler` with a `SpecDecoder` attached (as `dsctl serve` runs
them, greedy), then every measured step is one spec step of all of them: draft extend, draft tree, tree
verify, acceptance, commit, emission. The stand-in runner answers every forward from fixed tables (the
target's argmax of token t is f(t); the draft proposes f(t) first for 3 tokens in 4 and second
otherwise, so paths are accepted and rejected at every depth); it does what the real runner does on
the host for a tree forward (the KV lists into the request table's scratch rows) and nothing else.

Per spec step it reports:
- `wall ms`: mean wall time of the scheduler's step, the stand-in forwards' own time excluded (a pass
  without instrumentation);
- `torch ops`: aten operators dispatched (a `TorchDispatchMode` counter; the stand-in forwards' own
  ops excluded), and `non-view`: those that are not views (on a GPU each launches a kernel, about
  5-10 us of CPU time; a view costs a microsecond or two);
- `h2d`: host-to-device copies, and `syncs`: reads of device values on the host (`.tolist()`,
  `.item()`, `int()`, a copy to the host, ops with data-dependent shapes), each of which waits for the
  GPU. On CPU every tensor is a host tensor, so the runner's device is `cpu:0` here: a tensor counts as
  a device tensor when it was made on `cpu:0` or computed from one (the request table, the forwards'
  outputs, everything `tensor_to_device` copies).
- `accept`: the mean accepted length (the same before and after a change that keeps outputs identical).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine.forward_batch as forward_batch  # noqa: E402
from engine.args import SchedulerArgs, SpeculativeArgs  # noqa: E402
from engine.memory.pools import KVPool, ReqToTokenPool  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.scheduler.processor import OutputProcessor  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.speculative.decoder import SpecDecoder  # noqa: E402

VOCAB, HIDDEN = 64, 16
DEVICE = torch.device("cpu", 0)  # "the GPU": tensors made here count as device tensors


# ---- device-tensor bookkeeping and counting ------------------------------------------------------
class Counter(TorchDispatchMode):
    """Tags device tensors (made on DEVICE or computed from one) and, while `counting`, counts aten ops,
    host-to-device copies and host reads of device values. `paused` hides the stand-in forwards' ops."""

    DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.tags = WeakIdKeyDictionary()
        self.counting = self.paused = False
        self.ops = self.kernels = self.h2d = self.syncs = 0

    def tag(self, t):
        if isinstance(t, torch.Tensor):
            self.tags[t] = True
        return t

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.tags

    def count_sync(self, t) -> None:
        if self.counting and not self.paused and self.on_device(t):
            self.syncs += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = [*args, *kwargs.values()]
        flat += [x for a in args if isinstance(a, (list, tuple)) for x in a]  # cat / index lists
        src_dev = any(self.on_device(a) for a in flat)
        dst = kwargs.get("device")
        name = func.__name__.split(".")[0]
        counted = self.counting and not self.paused
        if counted:
            self.ops += 1
            self.kernels += not func.is_view
            if name == "_to_copy" and dst == DEVICE and not src_dev:
                self.h2d += 1
            if src_dev and (name == "_local_scalar_dense" or name in self.DATA_DEPENDENT
                            or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                        for i in args[1]))):
                self.syncs += 1
        if src_dev or dst == DEVICE:
            for o in (out if isinstance(out, (list, tuple)) else [out]):
                self.tag(o)
        return out


@contextmanager
def instrumented(counter: Counter):
    """Count the host reads that do not dispatch an aten op on CPU: `.tolist()`, `.cpu()` and `.to("cpu")`
    (no-ops here; a CPU tensor's own `.device` is plain "cpu" too, so only the literal "cpu" counts as the
    host); and make `tensor_to_device` (a no-op for a CPU tensor) a real copy to DEVICE. Restored on exit."""
    tolist, to, cpu = torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cpu
    real_t2d = forward_batch.tensor_to_device

    def counted_tolist(self):
        counter.count_sync(self)
        return tolist(self)

    def to_host(self, out):
        if not counter.on_device(self):
            return out
        counter.count_sync(self)
        out = out.clone() if out is self else out
        counter.tags.pop(out, None)
        return out

    def counted_to(self, *args, **kwargs):
        dev = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        out = to(self, *args, **kwargs)
        return to_host(self, out) if dev == "cpu" else out

    def counted_cpu(self, *args, **kwargs):
        return to_host(self, cpu(self, *args, **kwargs))

    def tensor_to_device(t, device):  # always host to device (a table's own .device reads "cpu" here)
        if counter.on_device(t):
            return real_t2d(t, device)
        return counter.tag(t.to(DEVICE, copy=True))

    users = [m for m in list(sys.modules.values()) if getattr(m, "tensor_to_device", None) is real_t2d]
    torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cpu = counted_tolist, counted_to, counted_cpu
    for mod in users:  # forward_batch and the modules that imported it by name
        mod.tensor_to_device = tensor_to_device
    try:
        yield counter
    finally:
        torch.Tensor.tolist, torch.Tensor.to, torch.Tensor.cpu = tolist, to, cpu
        for mod in users:
            mod.tensor_to_device = real_t2d


# ---- the stand-in runner -------------------------------------------------------------------------------
@dataclass
class _Config:
    vocab_size: int
    hidden_size: int


@dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits per input token: the target's argmax of t is f(t) = (5t + 3) % V; the draft
    ranks f(t) first unless t % 4 == 0 (then second) or t % 7 == 0 (then last)."""
    g = torch.Generator().manual_seed(0)
    t = torch.arange(VOCAB)
    f = (5 * t + 3) % VOCAB
    target = torch.randn(VOCAB, VOCAB, generator=g)
    target[t, f] = 20.0
    draft = torch.randn(VOCAB, VOCAB, generator=g)
    draft[t, f] = torch.where(t % 4 == 0, 9.0, 10.0)
    draft[t, (f + 1) % VOCAB] = torch.where(t % 4 == 0, 10.0, 9.0)
    draft[t, f] = torch.where(t % 7 == 0, -10.0, draft[t, f])
    return target, draft


class StandInRunner:
    """What the scheduler and the spec decoder read of a ModelRunner; forwards answer from `_tables`."""

    def __init__(self, counter: Counter, max_running: int, max_model_len: int, kv_tokens: int, scratch: int):
        self.counter = counter
        self.device = DEVICE
        self.config = _Config(VOCAB, HIDDEN)
        self.max_model_len = max_model_len
        self.max_running_requests = max_running
        self.kv_pool = KVPool(2, kv_tokens, 1, torch.float32, torch.device("cpu"))
        self.req_to_token = ReqToTokenPool(max_running, max_model_len + 1, DEVICE)
        self.req_to_token.reserve_scratch(scratch)  # as with CUDA graphs: tree rows go to scratch rows
        counter.tag(self.req_to_token.table)
        self.target, self.draft_table = _tables()
        self.draft = StandInDraft(self)
        self.dp = None  # no DP attention
        self.forward_s = 0.0

    def answer(self, fb, table: torch.Tensor) -> _Out:
        t, self.counter.paused = time.perf_counter(), True
        try:
            ids = fb.input_ids[fb.logits_indices]
            out = _Out(table[ids], torch.zeros(fb.num_tokens, HIDDEN))
            self.counter.tag(out.logits), self.counter.tag(out.hidden)
        finally:
            self.counter.paused = False
            self.forward_s += time.perf_counter() - t
        return out

    def forward(self, fb) -> _Out:
        return self.answer(fb, self.target)

    def share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens  # one process


class StandInDraft:
    """What the spec decoder reads of a DraftRunner: the draft's forwards answer from the runner's draft table."""

    def __init__(self, runner: StandInRunner):
        self.runner = runner

    def forward(self, fb) -> _Out:
        return self.runner.answer(fb, self.runner.draft_table)


# ---- the measurement ----------------------------------------------------------------------------------
def _engine(counter: Counter, bs: int, tree: tuple[int, int, int], context: int, steps: int):
    n_steps, topk, nodes = tree
    max_len = context + (steps + 40) * (n_steps + 1) + 8
    per_req = max_len + nodes + n_steps * topk
    runner = StandInRunner(counter, bs, max_len, bs * per_req + 16, bs * max(nodes, topk))
    outputs = OutputProcessor(None, set(), max_len)
    args = SchedulerArgs(max_running_requests=bs, max_prefill_tokens=context * 8, chunked_prefill_size=-1)
    sched = Scheduler(runner, outputs, args, radix_cache=True)
    sched.spec = SpecDecoder(runner, SpeculativeArgs(speculative_algorithm="NEXTN", speculative_num_steps=n_steps,
                                                     speculative_eagle_topk=topk, speculative_num_draft_tokens=nodes))
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=10 ** 6, temperature=0, ignore_eos=True)
    for i in range(bs):
        sched.add(Request.new(str(i), torch.randint(0, VOCAB, (context,), generator=g).tolist(), params))
    while sched.waiting or sched.prefilling is not None:
        sched.step()
        sched.take_outputs()
    return sched, runner


def measure(bs: int, tree: tuple[int, int, int], context: int, steps: int, warmup: int) -> dict:
    """One (batch, tree) row: counts over steps / 4 spec steps, then wall time over `steps` more."""
    counter = Counter()
    counted = max(1, steps // 4)
    with instrumented(counter):
        with counter:
            sched, runner = _engine(counter, bs, tree, context, steps + counted)
            for _ in range(warmup):
                sched.step()
                sched.take_outputs()
            counter.counting = True
            for _ in range(counted):
                sched.step()
                sched.take_outputs()
            counter.counting = False
        times = []
        for _ in range(steps):  # timed without the counter (its dispatch hook costs more than the ops)
            f0, t = runner.forward_s, time.perf_counter()
            sched.step()
            sched.take_outputs()
            times.append(time.perf_counter() - t - (runner.forward_s - f0))
    spec = sched.spec.stats
    return {"batch": bs, "tree": "x".join(map(str, tree)), "wall_ms": statistics.fmean(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3, "ops": counter.ops / counted,
            "kernels": counter.kernels / counted,
            "h2d": counter.h2d / counted, "syncs": counter.syncs / counted, "accept": spec.mean,
            "hist": tuple(spec.hist)}


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--trees", nargs="+", default=["3,4,8", "2,4,4"], help="steps,topk,num_draft_tokens")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=100, help="timed spec steps (a quarter as many are counted)")
    ap.add_argument("--warmup", type=int, default=10)
    opts = ap.parse_args(argv)
    torch.set_num_threads(1)  # host work is single-threaded; extra threads only add noise here
    rows = []
    print(f"{'tree':>7} {'batch':>5} {'wall ms':>8} {'median':>7} {'torch ops':>9} {'non-view':>8} {'h2d':>5} "
          f"{'syncs':>5} {'accept':>6}")
    for tree in opts.trees:
        shape = tuple(int(x) for x in tree.split(","))
        for bs in opts.batch_sizes:
            r = measure(bs, shape, opts.context, opts.steps, opts.warmup)
            rows.append(r)
            print(f"{r['tree']:>7} {bs:>5} {r['wall_ms']:>8.3f} {r['median_ms']:>7.3f} {r['ops']:>9.1f} "
                  f"{r['kernels']:>8.1f} {r['h2d']:>5.1f} {r['syncs']:>5.1f} {r['accept']:>6.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
