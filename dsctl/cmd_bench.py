"""`dsctl bench`: benchmarks. `bench serving` loads any OpenAI-compatible server;
`bench one-batch` times one static batch through the model runner.

Only flag parsing lives here; the logic is in dsctl/bench_serving/ and
dsctl/bench_one_batch.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from dsctl.flags import engine_command
from engine.args import GPU, MODEL, EngineArgs

bench_app = typer.Typer(help="Benchmarks: `serving` (any OpenAI-compatible server), `one-batch` (model runner).",
                        no_args_is_help=True)


@bench_app.command("serving")
def serving(
    base_url: str = typer.Option(..., "--base-url",
                                 help="Server root, e.g. http://127.0.0.1:30000 (with or without /v1)."),
    model: Optional[str] = typer.Option(None, "--model",
                                        help="Model name to request (default: the first of /v1/models)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions (/v1/completions) or chat."),
    dataset: str = typer.Option("random", "--dataset", help="random, sharegpt or jsonl."),
    dataset_path: Optional[Path] = typer.Option(None, "--dataset-path", help="ShareGPT JSON or JSONL file."),
    num_prompts: int = typer.Option(200, "--num-prompts", min=1, help="Requests to send."),
    request_rate: str = typer.Option("inf", "--request-rate",
                                     help="Poisson arrivals per second, or inf (all at once)."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", min=1, help="Cap on requests in flight."),
    random_input_len: int = typer.Option(1024, "--random-input-len", min=1, help="Prompt tokens (random dataset)."),
    random_output_len: int = typer.Option(128, "--random-output-len", min=1, help="Output tokens (random dataset)."),
    random_range_ratio: float = typer.Option(1.0, "--random-range-ratio",
                                             help="Lengths uniform in [len*ratio, len]; 1 = fixed."),
    sharegpt_output_len: Optional[int] = typer.Option(None, "--sharegpt-output-len",
                                                      help="Override ShareGPT output lengths."),
    seed: int = typer.Option(0, "--seed", help="Seed for prompts and arrival times."),
    warmup: int = typer.Option(0, "--warmup", min=0, help="Untimed requests sent first."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="TTFT SLO for goodput."),
    slo_tpot_ms: Optional[float] = typer.Option(None, "--slo-tpot-ms", help="TPOT SLO for goodput."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="tokenizer.json, checkpoint dir or cached repo "
                                                 "(default: --model's, if found)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer token."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly max_tokens."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Per-request timeout in seconds."),
    result_file: Optional[Path] = typer.Option(None, "--result-file", help="Append one JSON line of results here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write latency CDFs and throughput (PNG, matplotlib)."),
) -> None:
    """Benchmark an OpenAI-compatible server: throughput, TTFT, TPOT, ITL, E2E latency, goodput."""
    from rich.console import Console

    from dsctl.bench_serving.main import ServingOptions, run_serving

    opts = ServingOptions(**{k: v for k, v in locals().items() if k in ServingOptions.__dataclass_fields__})
    run_serving(opts, Console(highlight=False))


@bench_app.command("one-batch")
@engine_command(MODEL, GPU)
def one_batch(
    args: EngineArgs,
    batch_size: List[int] = typer.Option([1], "--batch-size", help="Batch sizes (e.g. --batch-size 1 8 32)."),
    input_len: int = typer.Option(256, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(32, "--output-len", help="Generated tokens per request (incl. the first)."),
    result_file: Optional[Path] = typer.Option(None, "--result-file", help="Append one JSON line per batch size."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Write a torch profiler trace (chrome JSON)."),
) -> None:
    """Prefill and decode latency/throughput of one batch, per batch size (no HTTP, no scheduler)."""
    from dsctl.bench_one_batch import print_table, run_one_batch

    print_table(run_one_batch(args, list(batch_size), input_len, output_len, result_file, profile))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
