"""`dsctl bench one-batch`: latency of one static batch through the model runner (no HTTP, no scheduler).

For each batch size and prompt/output length: one untimed warm-up run of exactly
that shape (first-use compilation, autotuning and CUDA-graph replays happen
there), then `repeats` timed runs. A run prefills `input_len` random tokens per
request, then decodes `output_len - 1` steps greedily, timing each forward with a
device sync. Reports medians with their spread (prefill min-max over repeats,
decode p10-p90 over every step), as a rich table that fits the terminal and as
JSON lines. `--profile` writes a torch profiler trace of one extra run per shape.
With --tp N (and DP attention or EP) the same runs go over N rank processes in lockstep
(dsctl/bench_one_batch_ranks.py; under DP attention each DP group runs its share of the batch).
With --speculative-algorithm the batch runs through the scheduler instead (the spec step lives
there): one prefill step, then spec steps; decode tok/s counts every token a step emits, and the
title gives the mean accepted length (tokens per request per step).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Union


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


def _sync(device) -> None:
    import torch

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


def _run_batch(runner, bs: int, input_len: int, output_len: int, seed: int) -> Optional[RunTimes]:
    """One prefill of bs x input_len random tokens, then output_len - 1 greedy decode steps, timed. Under
    DP attention this rank's group runs its share of the batch (`batch_share`) and every step ends when
    every group's forwards have run; None for a group with no share."""
    import torch

    g = torch.Generator().manual_seed(seed + bs)
    vocab = min(runner.config.vocab_size, 32000)
    prompts = torch.randint(0, vocab, (bs, input_len), generator=g)  # the same on every rank
    start, n = batch_share(bs, runner.parallel.tp)
    if n == 0:
        return _run_idle(runner, output_len)
    prompts = prompts[start: start + n]
    rows = [runner.req_to_token.alloc() for _ in range(n)]
    slots = runner.kv_pool.alloc(n * (input_len + output_len))
    if any(r is None for r in rows) or slots is None:
        raise RuntimeError("KV pool / request table too small for this batch (raise --max-total-tokens)")
    slots = slots.view(n, input_len + output_len)
    try:
        return _timed_run(runner, prompts, rows, slots, output_len)
    finally:
        runner.kv_pool.free(slots.flatten())
        for r in rows:
            runner.req_to_token.free(r)


def _timed_run(runner, prompts, rows: list[int], slots, output_len: int) -> RunTimes:
    from engine.forward_batch import ForwardBatch, ForwardMode

    n, input_len = prompts.shape
    for i, r in enumerate(rows):
        runner.req_to_token.set(r, 0, slots[i])
    fb = ForwardBatch.build(ForwardMode.EXTEND, prompts.flatten().tolist(), rows, [0] * n, [input_len] * n,
                            slots[:, :input_len].flatten(), [(i + 1) * input_len - 1 for i in range(n)],
                            runner.device)
    _sync(runner.device)
    t0 = time.perf_counter()
    next_ids = _step(runner, fb)
    _sync(runner.device)
    prefill = time.perf_counter() - t0
    decode_times = []
    for step in range(output_len - 1):
        pos = input_len + step
        dfb = ForwardBatch.build(ForwardMode.DECODE, [0] * n, rows, [pos] * n, [1] * n, slots[:, pos],
                                 list(range(n)), runner.device)
        dfb.input_ids = next_ids
        _sync(runner.device)
        t0 = time.perf_counter()
        next_ids = _step(runner, dfb)
        _sync(runner.device)
        decode_times.append(time.perf_counter() - t0)
    return RunTimes(prefill, decode_times)


def _step(runner, fb):
    """One forward and its greedy tokens; under DP attention, then the other groups' forwards (idle)."""
    next_ids = runner.forward(fb).logits.argmax(-1)
    if runner.dp_attention:
        runner.finish_dp_iteration()
    return next_ids


def _run_idle(runner, output_len: int) -> None:
    """A DP group with no share of the batch: join the other groups' prefill and decode steps idle (no
    times: this group ran no request)."""
    for _ in range(output_len):
        runner.finish_dp_iteration()


def _run_batch_spec(eng, bs: int, input_len: int, output_len: int, seed: int) -> tuple[RunTimes, float]:
    """Speculative decoding: the same static batch through a fresh scheduler (one prefill step, then spec
    steps until every request has output_len tokens), each step timed; also the mean accepted length."""
    import torch

    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed + bs)
    prompts = torch.randint(0, min(eng.config.vocab_size, 32000), (bs, input_len), generator=g).tolist()
    eng.scheduler = sched = eng.make_scheduler(disable_radix_cache=True)  # no cache hits between runs
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [eng.make_request(p, params) for p in prompts]
    for r in reqs:
        sched.add(r)
    _sync(eng.runner.device)
    t0 = time.perf_counter()
    while sched.waiting or sched.prefilling is not None:
        sched.step()
    sched.flush()
    _sync(eng.runner.device)
    prefill, steps = time.perf_counter() - t0, []
    while not all(r.finished for r in reqs):
        t0 = time.perf_counter()
        sched.step()
        _sync(eng.runner.device)
        steps.append(time.perf_counter() - t0)
    sched.take_outputs()
    return RunTimes(prefill, steps), sched.spec.stats.mean


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


def _as_list(x: Union[int, Sequence[int]]) -> list[int]:
    return [x] if isinstance(x, int) else list(x)


def _shapes(batch_sizes, input_lens, output_lens) -> list[tuple[int, int, int]]:
    return [(b, i, o) for i in input_lens for o in output_lens for b in batch_sizes]


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


@dataclass
class OneBatchRun:
    results: list[OneBatchResult]
    context: str  # model, layers, device, dtype: for the table title


def run_one_batch(args, batch_sizes: list[int], input_len: Union[int, Sequence[int]],
                  output_len: Union[int, Sequence[int]], result_file: Optional[Path], profile: Optional[Path],
                  repeats: int = 3) -> list[OneBatchResult]:
    """Time every (batch size, input length, output length); see the module docstring."""
    return bench(args, batch_sizes, input_len, output_len, result_file, profile, repeats).results


def bench(args, batch_sizes: list[int], input_len: Union[int, Sequence[int]], output_len: Union[int, Sequence[int]],
          result_file: Optional[Path] = None, profile: Optional[Path] = None, repeats: int = 3) -> OneBatchRun:
    from engine.errors import UsageError

    input_lens, output_lens = _as_list(input_len), _as_list(output_len)
    if min(input_lens + output_lens + list(batch_sizes)) < 1 or repeats < 1:
        raise UsageError("--batch-size, --input-len, --output-len and --repeats must all be >= 1")
    longest = max(input_lens) + max(output_lens)
    if args.cache.max_total_tokens is None:
        args = args.replace(max_total_tokens=max(batch_sizes) * longest)
    if args.model.max_model_len is None:
        args = args.replace(max_model_len=longest)
    args = args.replace(max_running_requests=max(args.scheduler.max_running_requests, max(batch_sizes)))
    if args.speculative.enabled:
        if args.parallel.config().world_size > 1:
            raise UsageError("bench one-batch with --speculative-algorithm runs one rank; for --tp > 1 measure "
                             "speculative decoding with `dsctl bench offline` or `dsctl serve` + `bench serving`")
        return _bench_spec(args, batch_sizes, input_lens, output_lens, result_file, repeats)
    shapes = _shapes(batch_sizes, input_lens, output_lens)
    with _progress() as progress:
        task = progress.add_task(f"loading {args.model.model} (weights, KV pool, CUDA graphs)",
                                 total=len(shapes) * (1 + repeats))

        def report(text: str) -> None:
            progress.update(task, description=text)
            progress.advance(task)

        results, meta = _bench_shapes(args, shapes, repeats, profile, report)
    if result_file is not None:
        _write_results(result_file, meta, results)
    context = f"{meta['model']}, {meta['num_layers']} layers, {meta['device']} {meta['dtype']}"
    if meta["layout"] != "tp1":
        context += f", {meta['layout']}"
    return OneBatchRun(results, context)


def _bench_shapes(args, shapes, repeats, profile, report) -> tuple[list[OneBatchResult], dict]:
    """Every shape timed in this process (one rank), or over this node's ranks (--tp > 1)."""
    from engine.ranked import check_launch, launch_args
    from engine.runner import ModelRunner

    args = launch_args(args)
    if args.parallel.config().world_size > 1:
        from dsctl.bench_one_batch_ranks import bench_ranked

        check_launch(args)
        return bench_ranked(args, shapes, repeats, profile, report)
    runner = ModelRunner(args)
    return time_shapes(runner, shapes, repeats, args.model.seed, report, profile), meta_of(args, runner)


def time_shapes(runner, shapes, repeats: int, seed: int, report, profile: Optional[Path] = None) -> list:
    """For each (batch size, input, output) shape: one untimed warm-up run, then `repeats` timed runs (and,
    with `profile`, one traced run); `report(text)` after each warm-up or timed run."""
    results = []
    for bs, ilen, olen in shapes:
        name = f"batch {bs}, in {ilen}, out {olen}"
        _run_batch(runner, bs, ilen, olen, seed)  # untimed: compiles and captures this shape
        report(f"{name}: warmed up")
        runs = []
        for k in range(repeats):
            runs.append(_run_batch(runner, bs, ilen, olen, seed + 1 + k))
            report(f"{name}: run {k + 1}/{repeats}")
        if profile is not None:
            _profiled(runner, bs, ilen, olen, seed, profile)
        if runs[0] is not None:  # (a DP group with no share of this batch has no times)
            results.append(summarize(bs, ilen, olen, runs))
    return results


def _bench_spec(args, batch_sizes, input_lens, output_lens, result_file, repeats) -> OneBatchRun:
    """`bench()` with speculative decoding: through the scheduler (the spec step lives there)."""
    from engine.engine import Engine

    longest = max(input_lens) + max(output_lens)
    spec = args.speculative
    room = max(batch_sizes) * (spec.speculative_num_draft_tokens + spec.speculative_num_steps * spec.speculative_eagle_topk)
    args = args.replace(max_total_tokens=args.cache.max_total_tokens + room, chunked_prefill_size=-1,
                        max_prefill_tokens=max(batch_sizes) * max(input_lens), max_model_len=longest + 16)
    shapes, results = _shapes(batch_sizes, input_lens, output_lens), []
    with _progress() as progress:
        task = progress.add_task(f"loading {args.model.model}", total=len(shapes) * (1 + repeats))
        eng = Engine(args)
        for bs, ilen, olen in shapes:
            _run_batch_spec(eng, bs, ilen, olen, args.model.seed)  # warm-up
            progress.advance(task)
            runs = [_run_batch_spec(eng, bs, ilen, olen, args.model.seed + 1 + k) for k in range(repeats)]
            progress.advance(task, repeats)
            results.append(summarize(bs, ilen, olen, [r for r, _ in runs],
                                     statistics.mean(a for _, a in runs)))
    meta = meta_of(args, eng.runner)
    if result_file is not None:
        _write_results(result_file, meta, results)
    accept = ", ".join(f"{r.accept_length:.2f}" for r in results)
    context = (f"{meta['model']}, {meta['num_layers']} layers, {meta['device']} {meta['dtype']}, "
               f"{spec.speculative_algorithm} {spec.speculative_num_steps}/{spec.speculative_eagle_topk}/"
               f"{spec.speculative_num_draft_tokens}, accepted length {accept}")
    return OneBatchRun(results, context)


def meta_of(args, runner) -> dict:
    """What the result lines and the table title say of the run: model, depth, device, dtype, layout."""
    return {"model": args.model.model, "load_format": args.model.load_format, "num_layers": runner.num_layers,
            "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
            "layout": layout_name(runner.parallel.tp)}


def layout_name(tp) -> str:
    """"tp2", "tp2 dp2", "tp2 ep2": the parallel layout of a run, as the tables name it."""
    parts = [f"tp{tp.size}"] + ([f"dp{tp.dp_size}"] if tp.dp_size > 1 else []) + \
        ([f"ep{tp.ep_size}"] if tp.ep_size > 1 else [])
    return " ".join(parts)


def _write_results(result_file: Path, meta: dict, results: list[OneBatchResult]) -> None:
    with open(result_file, "a") as f:
        for r in results:
            f.write(json.dumps({**meta, "timestamp": time.time(), **asdict(r)}) + "\n")


def _profiled(runner, bs, input_len, output_len, seed, profile: Path) -> None:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        _run_batch(runner, bs, input_len, output_len, seed)
    tp = runner.parallel.tp
    rank = f"-rank{tp.rank}" if tp.size > 1 else ""  # every rank traces its own run
    path = profile.with_name(f"{profile.stem}{rank}-bs{bs}-in{input_len}-out{output_len}{profile.suffix or '.json'}")
    prof.export_chrome_trace(str(path))
