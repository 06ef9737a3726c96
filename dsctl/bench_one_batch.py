"""`dsctl bench one-batch`: latency of one static batch through the model runner (no HTTP, no scheduler).

For each batch size: prefill `input_len` random tokens per request, then decode
`output_len - 1` steps greedily, timing each forward with a device sync. Reports
prefill latency/throughput, median decode latency/throughput and the total, as a
rich table and as JSON lines. `--profile` writes a torch profiler trace.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_latency_s: float
    prefill_throughput_tok_s: float
    median_decode_latency_s: float
    median_decode_throughput_tok_s: float
    total_latency_s: float
    overall_throughput_tok_s: float


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_batch(runner, bs: int, input_len: int, output_len: int, seed: int) -> OneBatchResult:
    import torch

    from engine.forward_batch import ForwardBatch, ForwardMode

    g = torch.Generator().manual_seed(seed + bs)
    vocab = min(runner.config.vocab_size, 32000)
    prompts = torch.randint(0, vocab, (bs, input_len), generator=g)
    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    slots = runner.kv_pool.alloc(bs * (input_len + output_len))
    if any(r is None for r in rows) or slots is None:
        raise RuntimeError("KV pool / request table too small for this batch (raise --max-total-tokens)")
    slots = slots.view(bs, input_len + output_len)
    try:
        for i, r in enumerate(rows):
            runner.req_to_token.set(r, 0, slots[i])
        fb = ForwardBatch.build(ForwardMode.EXTEND, prompts.flatten().tolist(), rows, [0] * bs, [input_len] * bs,
                                slots[:, :input_len].flatten(), [(i + 1) * input_len - 1 for i in range(bs)],
                                runner.device)
        _sync(runner.device)
        t0 = time.perf_counter()
        out = runner.forward(fb)
        next_ids = out.logits.argmax(-1)
        _sync(runner.device)
        prefill = time.perf_counter() - t0
        decode_times = []
        for step in range(output_len - 1):
            pos = input_len + step
            dfb = ForwardBatch.build(ForwardMode.DECODE, [0] * bs, rows, [pos] * bs, [1] * bs, slots[:, pos],
                                     list(range(bs)), runner.device)
            dfb.input_ids = next_ids
            _sync(runner.device)
            t0 = time.perf_counter()
            next_ids = runner.forward(dfb).logits.argmax(-1)
            _sync(runner.device)
            decode_times.append(time.perf_counter() - t0)
    finally:
        runner.kv_pool.free(slots.flatten())
        for r in rows:
            runner.req_to_token.free(r)
    med = statistics.median(decode_times) if decode_times else float("nan")
    total = prefill + sum(decode_times)
    return OneBatchResult(
        batch_size=bs, input_len=input_len, output_len=output_len,
        prefill_latency_s=prefill, prefill_throughput_tok_s=bs * input_len / prefill,
        median_decode_latency_s=med, median_decode_throughput_tok_s=bs / med if decode_times else float("nan"),
        total_latency_s=total, overall_throughput_tok_s=bs * (input_len + output_len) / total,
    )


def run_one_batch(args, batch_sizes: list[int], input_len: int, output_len: int,
                  result_file: Optional[Path], profile: Optional[Path]) -> list[OneBatchResult]:
    from engine.errors import UsageError
    from engine.runner import ModelRunner

    if input_len < 1 or output_len < 1 or any(b < 1 for b in batch_sizes):
        raise UsageError("--batch-size, --input-len and --output-len must all be >= 1")
    need = max(batch_sizes) * (input_len + output_len)
    if args.max_total_tokens is None:
        args = args.replace(max_total_tokens=need)
    if args.max_model_len is None:
        args = args.replace(max_model_len=input_len + output_len)
    args = args.replace(max_running_requests=max(args.max_running_requests, max(batch_sizes)))
    runner = ModelRunner(args)
    _run_batch(runner, min(batch_sizes), min(input_len, 16), 2, args.seed)  # warm-up
    results = []
    for bs in batch_sizes:
        if profile is not None:
            results.append(_profiled(runner, bs, input_len, output_len, args.seed, profile))
        else:
            results.append(_run_batch(runner, bs, input_len, output_len, args.seed))
    if result_file is not None:
        with open(result_file, "a") as f:
            for r in results:
                f.write(json.dumps({"model": args.model, "load_format": args.load_format, "num_layers": runner.num_layers,
                                    "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
                                    "timestamp": time.time(), **asdict(r)}) + "\n")
    return results


def _profiled(runner, bs, input_len, output_len, seed, profile: Path) -> OneBatchResult:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        res = _run_batch(runner, bs, input_len, output_len, seed)
    path = profile.with_name(f"{profile.stem}-bs{bs}{profile.suffix or '.json'}")
    prof.export_chrome_trace(str(path))
    return res


def print_table(results: list[OneBatchResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench one-batch")
    for col in ("batch", "in", "out", "prefill ms", "prefill tok/s", "decode ms (median)", "decode tok/s",
                "total s", "overall tok/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.batch_size), str(r.input_len), str(r.output_len), f"{r.prefill_latency_s * 1e3:.2f}",
                      f"{r.prefill_throughput_tok_s:.1f}", f"{r.median_decode_latency_s * 1e3:.3f}",
                      f"{r.median_decode_throughput_tok_s:.1f}", f"{r.total_latency_s:.3f}",
                      f"{r.overall_throughput_tok_s:.1f}")
    Console().print(table)
