"""`bench one-batch`'s timing of static batches on one ModelRunner (one rank, or each rank of --tp N).

`time_shapes(runner, shapes, ...)`: for each (batch size, input length, output length) one untimed
warm-up run, then timed runs (`run_batch`: the prefill, then greedy decode steps, each timed with a device
sync), summarised as an `OneBatchResult` (medians and their spread). The prefill runs as the server's
scheduler would step it (`prefill_plan`): forwards of at most the step budget (--max-prefill-tokens, and
--chunked-prefill-size when chunking) new tokens, whole prompts together, a longer prompt alone in chunks;
so a large batch of long prompts fits the memory the server plans for. Under DP attention each DP group
runs its share of the batch (`batch_share`), and as many prefill forwards as the largest share. `meta_of` / `layout_name`: what
the results say of the run. `add_floors`: each result's decode step against its bytes floor on this
runner's layout (engine/distributed/step_floor.py) at the copy bandwidth `measure_bandwidth` took
before the runner was built (CUDA only: on CPU there is none, and the floor fields stay None).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from engine.distributed.step_floor import copy_bandwidth, step_floor_s
from engine.forward_batch import ForwardBatch, ForwardMode

DECODE_MARK = "one-batch decode steps"  # the profiler range around a run's decode steps (benchmarks/decode_kernels.py)


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    repeats: int
    prefill_latency_s: float  # median over repeats
    prefill_latency_min_s: float
    prefill_latency_max_s: float
    prefill_throughput_tok_s: float
    median_decode_latency_s: float  # median over every decode step of every repeat
    decode_latency_p10_s: float
    decode_latency_p90_s: float
    median_decode_throughput_tok_s: float
    total_latency_s: float  # median over repeats
    overall_throughput_tok_s: float
    accept_length: Optional[float] = None  # speculative decoding: tokens per request per decode step
    decode_floor_ms: Optional[float] = None  # the decode step's bytes floor per GPU (None: no bandwidth measured)
    decode_vs_floor: Optional[float] = None  # median decode step / that floor


@dataclass
class RunTimes:
    prefill_s: float
    decode_s: list[float]

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.decode_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of a non-empty sequence."""
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_share(bs: int, tp) -> tuple[int, int]:
    """(first request, count) of a batch of bs requests that this rank's group runs: the whole batch,
    or under DP attention its DP group's share (bs // dp each, the first bs % dp groups one more)."""
    if tp.dp_size == 1:
        return 0, bs
    base, extra = divmod(bs, tp.dp_size)
    g = tp.dp_rank
    return g * base + min(g, extra), base + (g < extra)


def prefill_plan(n: int, input_len: int, budget: int) -> list[tuple[int, int, int, int]]:
    """The prefill forwards of n prompts of input_len tokens with at most `budget` new tokens each, as the
    scheduler steps them: (first request, requests, cached prefix, new tokens) per forward. Whole prompts
    together while they fit; a longer prompt alone, in chunks of `budget` (the last one shorter)."""
    if input_len <= budget:
        per = budget // input_len
        return [(i, min(per, n - i), 0, input_len) for i in range(0, n, per)]
    return [(i, 1, p, min(budget, input_len - p)) for i in range(n) for p in range(0, input_len, budget)]


def run_batch(runner, bs: int, input_len: int, output_len: int, seed: int) -> Optional[RunTimes]:
    """The prefill of bs x input_len random tokens (`prefill_plan`), then output_len - 1 greedy decode
    steps, timed. Under DP attention this rank's group runs its share of the batch (`batch_share`) and
    every step ends when every group's forwards have run; None for a group with no share."""
    g = torch.Generator().manual_seed(seed + bs)
    vocab = min(runner.config.vocab_size, 32000)
    prompts = torch.randint(0, vocab, (bs, input_len), generator=g)  # the same on every rank
    tp = runner.parallel.tp
    budget = runner.args.group_step_budget()  # a DP group's share, as the server's
    start, n = batch_share(bs, tp)
    forwards = len(prefill_plan(-(-bs // tp.dp_size), input_len, budget))  # the largest group's
    if n == 0:
        return _run_idle(runner, forwards + output_len - 1)
    prompts = prompts[start: start + n]
    rows = [runner.req_to_token.alloc() for _ in range(n)]
    slots = runner.kv_pool.alloc(n * (input_len + output_len))
    if any(r is None for r in rows) or slots is None:
        raise RuntimeError("KV pool / request table too small for this batch (raise --max-total-tokens)")
    slots = slots.view(n, input_len + output_len)
    try:
        return _timed_run(runner, prompts, rows, slots, output_len, prefill_plan(n, input_len, budget), forwards)
    finally:
        runner.kv_pool.free(slots.flatten())
        for r in rows:
            runner.req_to_token.free(r)


def _timed_run(runner, prompts, rows: list[int], slots, output_len: int, plan, forwards: int) -> RunTimes:
    n, input_len = prompts.shape
    for i, r in enumerate(rows):
        runner.req_to_token.set(r, 0, slots[i])
    sync(runner.device)
    t0 = time.perf_counter()
    next_ids = prefill(runner, prompts, rows, slots, plan)
    for _ in range(forwards - len(plan)):  # a smaller DP share: join the largest group's remaining forwards
        runner.dp.finish_iteration()
    sync(runner.device)
    prefill_s = time.perf_counter() - t0
    decode_times = []
    with torch.profiler.record_function(DECODE_MARK):  # where a --profile trace's decode steps are
        for step in range(output_len - 1):
            pos = input_len + step
            dfb = ForwardBatch.build(ForwardMode.DECODE, [0] * n, rows, [pos] * n, [1] * n, slots[:, pos],
                                     list(range(n)), runner.device)
            dfb.input_ids = next_ids
            sync(runner.device)
            t0 = time.perf_counter()
            next_ids = _step(runner, dfb)
            sync(runner.device)
            decode_times.append(time.perf_counter() - t0)
    return RunTimes(prefill_s, decode_times)


def prefill(runner, prompts, rows: list[int], slots, plan) -> torch.Tensor:
    """Run `plan`'s prefill forwards over prompts [n, input_len] (KV slots [n, >= input_len], request rows
    already mapped to them); returns each prompt's greedy next token, in order."""
    input_len = prompts.shape[1]
    out = []
    for first, count, prefix, new in plan:
        part = slice(first, first + count)
        fb = ForwardBatch.build(ForwardMode.EXTEND, prompts[part, prefix:prefix + new].flatten().tolist(), rows[part],
                                [prefix] * count, [new] * count, slots[part, prefix:prefix + new].flatten(),
                                [(i + 1) * new - 1 for i in range(count)], runner.device)
        next_ids = _step(runner, fb)
        if prefix + new == input_len:  # the prompt's last chunk: its next token
            out.append(next_ids)
    return torch.cat(out)


def _step(runner, fb):
    """One forward and its greedy tokens; under DP attention, then the other groups' forwards (idle)."""
    next_ids = runner.forward(fb).logits.argmax(-1)
    if runner.dp is not None:
        runner.dp.finish_iteration()
    return next_ids


def _run_idle(runner, steps: int) -> None:
    """A DP group with no share of the batch: join the other groups' `steps` prefill and decode forwards
    idle (no times: this group ran no request)."""
    for _ in range(steps):
        runner.dp.finish_iteration()


def summarize(bs: int, input_len: int, output_len: int, runs: list[RunTimes],
              accept_length: Optional[float] = None) -> OneBatchResult:
    prefills = [r.prefill_s for r in runs]
    steps = [t for r in runs for t in r.decode_s]
    prefill = statistics.median(prefills)
    total = statistics.median(r.total_s for r in runs)
    nan = float("nan")
    decode = statistics.median(steps) if steps else nan
    return OneBatchResult(
        batch_size=bs, input_len=input_len, output_len=output_len, repeats=len(runs),
        prefill_latency_s=prefill, prefill_latency_min_s=min(prefills), prefill_latency_max_s=max(prefills),
        prefill_throughput_tok_s=bs * input_len / prefill,
        median_decode_latency_s=decode,
        decode_latency_p10_s=percentile(steps, 10) if steps else nan,
        decode_latency_p90_s=percentile(steps, 90) if steps else nan,
        median_decode_throughput_tok_s=bs * (accept_length or 1) / decode if steps else nan,
        total_latency_s=total, overall_throughput_tok_s=bs * (input_len + output_len) / total,
        accept_length=accept_length,
    )


def time_shapes(runner, shapes, repeats: int, seed: int, report, profile: Optional[Path] = None) -> list:
    """For each (batch size, input, output) shape: one untimed warm-up run, then `repeats` timed runs (and,
    with `profile`, one traced run); `report(text)` after each warm-up or timed run."""
    results = []
    for bs, ilen, olen in shapes:
        name = f"batch {bs}, in {ilen}, out {olen}"
        run_batch(runner, bs, ilen, olen, seed)  # untimed: compiles and captures this shape
        report(f"{name}: warmed up")
        runs = []
        for k in range(repeats):
            runs.append(run_batch(runner, bs, ilen, olen, seed + 1 + k))
            report(f"{name}: run {k + 1}/{repeats}")
        if profile is not None:
            _profiled(runner, bs, ilen, olen, seed, profile)
        if runs[0] is not None:  # (a DP group with no share of this batch has no times)
            results.append(summarize(bs, ilen, olen, runs))
    return results


def meta_of(args, runner, bandwidth: Optional[float] = None) -> dict:
    """What the result lines and the table title say of the run: model, depth, device, dtype, layout, and the
    copy bandwidth the floors are at (GB/s; None without one)."""
    return {"model": args.model.model, "load_format": args.model.load_format, "num_layers": runner.num_layers,
            "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
            "layout": layout_name(runner.parallel.tp),
            "copy_bandwidth_gbs": None if bandwidth is None else bandwidth / 1e9}


def measure_bandwidth(device) -> Optional[float]:
    """The device's copy bandwidth in bytes/s (before the runner takes its memory); None on CPU."""
    return copy_bandwidth(device) if torch.device(device).type == "cuda" else None


def add_floors(runner, results: list[OneBatchResult], bandwidth: Optional[float]) -> list[OneBatchResult]:
    """Each result with its decode step's bytes floor on one GPU of this runner's layout (context: input +
    output / 2 tokens; its weights, KV row and KV dtype) at `bandwidth`, and the median step over it."""
    if bandwidth is None:
        return results
    tp = runner.parallel.tp
    weight_bytes = 1 if runner.fp8_block else runner.dtype.itemsize
    for r in results:
        floor = step_floor_s(runner.config, runner.num_layers, r.batch_size, r.input_len + r.output_len // 2,
                             runner.setup.kv_dtype.itemsize, bandwidth, weight_bytes, tp.size, tp.dp_size,
                             runner.kv_row_dim)
        r.decode_floor_ms = floor * 1e3
        r.decode_vs_floor = r.median_decode_latency_s / floor
    return results


def layout_name(tp) -> str:
    """"tp2", "tp2 dp2", "tp2 ep2", "tp2 ep2 a2a": the parallel layout of a run, as the tables name it."""
    parts = [f"tp{tp.size}"] + ([f"dp{tp.dp_size}"] if tp.dp_size > 1 else []) + \
        ([f"ep{tp.ep_size}"] if tp.ep_size > 1 else []) + (["a2a"] if tp.exchanges_tokens else [])
    return " ".join(parts)


def _profiled(runner, bs, input_len, output_len, seed, profile: Path) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run_batch(runner, bs, input_len, output_len, seed)
    tp = runner.parallel.tp
    rank = f"-rank{tp.rank}" if tp.size > 1 else ""  # every rank traces its own run
    path = profile.with_name(f"{profile.stem}{rank}-bs{bs}-in{input_len}-out{output_len}{profile.suffix or '.json'}")
    prof.export_chrome_trace(str(path))
