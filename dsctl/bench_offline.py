"""`dsctl bench offline`: generation speed through the Engine (scheduler + runner), no HTTP.

Two figures, each timed after an untimed warm-up of the same shape:
- decode tok/s at batch 1: one request generating `output_len` tokens and the same
  prompt length generating 1 token; the difference is `output_len - 1` decode steps.
- output tok/s at `concurrency`: that many requests handed to `Engine.generate` at
  once (the scheduler batches them), output tokens / wall time; total tok/s counts
  the prompts too.
- with speculative decoding, the accepted tokens per request per decode step of the
  timed runs (both figures).
Prompts are random token ids, a fresh set for every run, so the radix cache never
turns a timed prefill into a cache hit; `ignore_eos` makes every request produce
exactly `output_len` tokens. Lengths default to small values on CPU, larger on CUDA.
With --tp N the engine runs as N rank processes (engine.runtime.offline.open_engine), so
`bench ablation` can measure EP-MoE and DP attention rows; it runs this command once
per configuration.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from engine.errors import UsageError
from engine.speculative.stats import mean_accepted

CPU_DEFAULTS = {"input_len": 32, "output_len": 16, "concurrency": 4}
CUDA_DEFAULTS = {"input_len": 512, "output_len": 256, "concurrency": 64}


@dataclass
class OfflineResult:
    model: str
    device: str
    dtype: str
    input_len: int
    output_len: int
    concurrency: int
    repeats: int
    decode_tok_s_bs1: float  # median over repeats
    prefill_s_bs1: float  # time to the first token of one request (median)
    output_tok_s: float  # at `concurrency` (median)
    total_tok_s: float  # prompts + outputs at `concurrency` (median)
    # speculative decoding: mean tokens per request per decode step in the timed runs (median; None when off)
    accept_length_bs1: Optional[float] = None
    accept_length: Optional[float] = None  # at `concurrency`


class _Prompts:
    """Fresh random prompts: every call returns ids never used before in this run."""

    def __init__(self, vocab: int, seed: int):
        import torch  # lazy: keeps dsctl --help fast (cmd_bench reads this module's defaults for its help)

        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def take(self, n: int, length: int) -> list[list[int]]:
        import torch  # lazy: keeps dsctl --help fast (cmd_bench reads this module's defaults for its help)

        return torch.randint(0, self.vocab, (n, length), generator=self.gen).tolist()


def _timed_generate(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, Optional[float]]:
    """Seconds, output tokens, and the mean accepted tokens per request-step of the call (None without
    speculative steps)."""
    from engine.sampling import SamplingParams  # lazy: imports torch; keeps dsctl --help fast

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    hist = engine.spec_accept_hist()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.token_ids) for o in outs), mean_accepted(hist, engine.spec_accept_hist())


def _lengths(device_type: str, input_len, output_len, concurrency) -> tuple[int, int, int]:
    d = CPU_DEFAULTS if device_type == "cpu" else CUDA_DEFAULTS
    return (input_len or d["input_len"], output_len or d["output_len"], concurrency or d["concurrency"])


def run_offline(args, input_len: Optional[int] = None, output_len: Optional[int] = None,
                concurrency: Optional[int] = None, repeats: int = 1, progress=None) -> OfflineResult:
    """Build the Engine from `args` and measure (see the module docstring). `progress(text)` reports steps."""
    # lazy: both import torch; keeps dsctl --help fast (cmd_bench reads this module's defaults for its help)
    from engine.runner.device import pick_device, pick_dtype
    from engine.runtime.offline import open_engine  # lazy: imports torch; keeps dsctl --help fast

    say = progress or (lambda text: None)
    if min(x for x in (input_len, output_len, concurrency, repeats) if x is not None) < 1:
        raise UsageError("--input-len, --output-len, --concurrency and --repeats must be >= 1")
    say("starting the engine")
    device = pick_device(args.model.device)
    engine = open_engine(args)  # --tp N: N rank processes driven from here
    try:
        return _measure(engine, args, device, pick_dtype(args.model.dtype, device), input_len, output_len,
                        concurrency, repeats, say)
    finally:
        getattr(engine, "close", lambda: None)()


def _measure(engine, args, device, dtype, input_len, output_len, concurrency, repeats, say) -> OfflineResult:
    ilen, olen, conc = _lengths(device.type, input_len, output_len, concurrency)
    prompts = _Prompts(min(engine.config.vocab_size, 32000), args.model.seed)
    say("warm-up")
    _timed_generate(engine, prompts.take(1, ilen), olen)
    _timed_generate(engine, prompts.take(conc, ilen), olen)
    decode, prefill, out_rate, total_rate, accept_bs1, accept = [], [], [], [], [], []
    for k in range(repeats):
        say(f"batch 1, run {k + 1}/{repeats}")
        t_first, _, _ = _timed_generate(engine, prompts.take(1, ilen), 1)
        t_all, n, accepted = _timed_generate(engine, prompts.take(1, ilen), olen)
        accept_bs1.append(accepted)
        prefill.append(t_first)
        decode.append((n - 1) / max(t_all - t_first, 1e-9))
        say(f"{conc} concurrent, run {k + 1}/{repeats}")
        t_conc, n, accepted = _timed_generate(engine, prompts.take(conc, ilen), olen)
        accept.append(accepted)
        out_rate.append(n / t_conc)
        total_rate.append((n + conc * ilen) / t_conc)
    med = statistics.median

    def med_or_none(values):
        values = [v for v in values if v is not None]
        return med(values) if values else None

    return OfflineResult(
        model=args.model.model, device=str(device), dtype=str(dtype).replace("torch.", ""),
        input_len=ilen, output_len=olen, concurrency=conc, repeats=repeats, decode_tok_s_bs1=med(decode),
        prefill_s_bs1=med(prefill), output_tok_s=med(out_rate), total_tok_s=med(total_rate),
        accept_length_bs1=med_or_none(accept_bs1), accept_length=med_or_none(accept))


def write_result(path: Path, result: OfflineResult) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"timestamp": time.time(), **asdict(result)}) + "\n")


def print_result(result: OfflineResult) -> None:
    table = Table(title=f"bench offline: {result.model} on {result.device} {result.dtype}, input "
                        f"{result.input_len}, output {result.output_len} tokens", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_row("decode tok/s at batch 1", f"{result.decode_tok_s_bs1:.1f}")
    table.add_row("time to first token at batch 1", f"{result.prefill_s_bs1 * 1e3:.1f} ms")
    table.add_row(f"output tok/s at {result.concurrency} concurrent", f"{result.output_tok_s:.1f}")
    table.add_row(f"total tok/s at {result.concurrency} concurrent", f"{result.total_tok_s:.1f}")
    if result.accept_length_bs1 is not None:
        table.add_row("accepted tokens per step at batch 1", f"{result.accept_length_bs1:.2f}")
    if result.accept_length is not None:
        table.add_row(f"accepted tokens per step at {result.concurrency} concurrent", f"{result.accept_length:.2f}")
    Console().print(table)
