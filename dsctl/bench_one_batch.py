"""`dsctl bench one-batch`: latency of one static batch through the model runner (no HTTP, no scheduler).

For each batch size and prompt/output length: one untimed warm-up run of exactly
that shape (first-use compilation, autotuning and CUDA-graph replays happen
there), then `repeats` timed runs. A run prefills `input_len` random tokens per
request in the forwards the server's scheduler would step them in (at most the step
budget of new tokens each: --max-prefill-tokens, --chunked-prefill-size), then decodes
`output_len - 1` steps greedily, timing each with a device sync. Reports medians with their spread (prefill min-max over repeats,
decode p10-p90 over every step), as a rich table that fits the terminal and as
JSON lines. `--profile` writes a torch profiler trace of one extra run per shape.
The timing itself is dsctl/bench_one_batch_timing.py. With --tp N (and DP attention or EP) the
same runs go over N rank processes in lockstep (dsctl/bench_one_batch_ranks.py; under DP attention
each DP group runs its share of the batch).
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

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dsctl.bench_one_batch_ranks import bench_ranked
from dsctl.bench_one_batch_timing import (
    OneBatchResult,
    RunTimes,
    add_floors,
    measure_bandwidth,
    meta_of,
    summarize,
    sync,
    time_shapes,
)
from engine.engine import Engine
from engine.errors import UsageError
from engine.runner.device import pick_device
from engine.runner.model_runner import ModelRunner
from engine.runtime.launch_checks import check_launch, launch_args
from engine.sampling import SamplingParams


def _run_batch_spec(eng, bs: int, input_len: int, output_len: int, seed: int) -> tuple[RunTimes, float]:
    """Speculative decoding: the same static batch through a fresh scheduler (one prefill step, then spec
    steps until every request has output_len tokens), each step timed; also the mean accepted length."""
    g = torch.Generator().manual_seed(seed + bs)
    prompts = torch.randint(0, min(eng.config.vocab_size, 32000), (bs, input_len), generator=g).tolist()
    eng.scheduler = sched = eng.make_scheduler(disable_radix_cache=True)  # no cache hits between runs
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [eng.make_request(p, params) for p in prompts]
    for r in reqs:
        sched.add(r)
    sync(eng.runner.device)
    t0 = time.perf_counter()
    while sched.waiting or sched.prefilling is not None:
        sched.step()
    sched.flush()
    sync(eng.runner.device)
    prefill, steps = time.perf_counter() - t0, []
    while not all(r.finished for r in reqs):
        t0 = time.perf_counter()
        sched.step()
        sync(eng.runner.device)
        steps.append(time.perf_counter() - t0)
    sched.take_outputs()
    return RunTimes(prefill, steps), sched.spec.stats.mean


def _as_list(x: Union[int, Sequence[int]]) -> list[int]:
    return [x] if isinstance(x, int) else list(x)


def _shapes(batch_sizes, input_lens, output_lens) -> list[tuple[int, int, int]]:
    return [(b, i, o) for i in input_lens for o in output_lens for b in batch_sizes]


def _progress():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


@dataclass
class OneBatchRun:
    results: list[OneBatchResult]
    context: str  # model, layers, device, dtype: for the table title
    note: str = ""  # under the table: what the floor columns are, or why there are none


def run_one_batch(args, batch_sizes: list[int], input_len: Union[int, Sequence[int]],
                  output_len: Union[int, Sequence[int]], result_file: Optional[Path], profile: Optional[Path],
                  repeats: int = 3) -> list[OneBatchResult]:
    """Time every (batch size, input length, output length); see the module docstring."""
    return bench(args, batch_sizes, input_len, output_len, result_file, profile, repeats).results


def bench(args, batch_sizes: list[int], input_len: Union[int, Sequence[int]], output_len: Union[int, Sequence[int]],
          result_file: Optional[Path] = None, profile: Optional[Path] = None, repeats: int = 3) -> OneBatchRun:
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
    return OneBatchRun(results, context, f"{_floor_note(meta)} {_prefill_note(args)}")


def _prefill_note(args) -> str:
    return (f"prefill: forwards of at most {args.group_step_budget()} new tokens"
            + (" per DP group" if args.attention_groups() > 1 else "") + ", whole prompts together and a longer one alone in chunks, "
            "as the server steps them (--max-prefill-tokens, --chunked-prefill-size).")


def _floor_note(meta: dict) -> str:
    bandwidth = meta["copy_bandwidth_gbs"]
    if bandwidth is None:
        return f"No bytes floor on {meta['device']}: there is no copy bandwidth to measure (CUDA only)."
    return (f"floor: the bytes one GPU's decode step reads (the weights it touches; the KV cache at input + "
            f"output / 2 tokens) at the {bandwidth:.0f} GB/s copy bandwidth measured here; x floor = decode / floor.")


def _bench_shapes(args, shapes, repeats, profile, report) -> tuple[list[OneBatchResult], dict]:
    """Every shape timed in this process (one rank), or over this node's ranks (--tp > 1)."""
    args = launch_args(args)
    if args.parallel.config().world_size > 1:
        check_launch(args)
        return bench_ranked(args, shapes, repeats, profile, report)
    bandwidth = measure_bandwidth(pick_device(args.model.device))  # before the runner takes the memory
    runner = ModelRunner(args)
    results = time_shapes(runner, shapes, repeats, args.model.seed, report, profile)
    return add_floors(runner, results, bandwidth), meta_of(args, runner, bandwidth)


def _bench_spec(args, batch_sizes, input_lens, output_lens, result_file, repeats) -> OneBatchRun:
    """`bench()` with speculative decoding: through the scheduler (the spec step lives there)."""
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
    return OneBatchRun(results, context, "No bytes floor with speculation: a step drafts and verifies several "
                                         "tokens per request.")


def _write_results(result_file: Path, meta: dict, results: list[OneBatchResult]) -> None:
    with open(result_file, "a") as f:
        for r in results:
            f.write(json.dumps({**meta, "timestamp": time.time(), **asdict(r)}) + "\n")
