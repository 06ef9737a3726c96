"""`dsctl bench`: benchmarks. `bench one-batch` (also plain `bench`) times one static batch
through the model runner; `bench offline` measures the Engine; `bench ablation` runs SGLang's
ablation grid, one `bench offline` process per row; `bench serving` loads any OpenAI-compatible
server.

Only flag parsing lives here; the logic is in dsctl/bench_one_batch.py, bench_offline.py,
bench_ablation.py (+ ablation_grid.py, ablation_report.py) and dsctl/bench_serving/.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from dsctl import ablation_report
from dsctl.ablation_grid import available_features, make_rows
from dsctl.bench_ablation import Settings, run_ablation
from dsctl.bench_offline import CPU_DEFAULTS, CUDA_DEFAULTS, print_result, run_offline, write_result
from dsctl.flags import engine_command, non_server_groups
from dsctl.help_format import DefaultCommandGroup
from engine.args import EngineArgs


class BenchGroup(DefaultCommandGroup):
    default_command = "one-batch"


bench_app = typer.Typer(
    cls=BenchGroup,
    help="Benchmarks. Without a sub-command, `one-batch`: `dsctl bench --batch-size 1 8` is "
         "`dsctl bench one-batch --batch-size 1 8` (see `dsctl bench one-batch --help`).",
)


@bench_app.command("one-batch")
@engine_command(*non_server_groups())
def one_batch(
    args: EngineArgs,
    batch_size: List[int] = typer.Option([1], "--batch-size", metavar="<int>...",
                                         help="Batch sizes (e.g. --batch-size 1 8 32)."),
    input_len: List[int] = typer.Option([256], "--input-len", metavar="<int>...",
                                        help="Prompt tokens per request (several: every one is run)."),
    output_len: List[int] = typer.Option([32], "--output-len", metavar="<int>...",
                                         help="Generated tokens per request, the first included (several: every "
                                              "one is run)."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed runs per shape, after one untimed warm-up; "
                                "the table shows medians and their spread."),
    result_file: Optional[Path] = typer.Option(None, "--result-file", help="Append one JSON line per shape."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Write a torch profiler trace (chrome JSON) of "
                                           "one extra run per shape."),
) -> None:
    """Prefill and decode latency/throughput of one static batch per shape (no HTTP, no scheduler)."""
    from dsctl.bench_one_batch import bench  # lazy: imports torch; keeps dsctl --help fast
    from dsctl.bench_one_batch_report import print_table  # lazy: imports torch; keeps dsctl --help fast

    run = bench(args, list(batch_size), list(input_len), list(output_len), result_file, profile, repeats)
    print_table(run.results, run.context, run.note)


_LEN_HELP = "(default: {cpu} on CPU, {cuda} on CUDA)."


def _len_help(what: str, key: str) -> str:
    return f"{what.rstrip('.')} " + _LEN_HELP.format(cpu=CPU_DEFAULTS[key], cuda=CUDA_DEFAULTS[key])


@bench_app.command("offline")
@engine_command(*non_server_groups())
def offline(
    args: EngineArgs,
    input_len: Optional[int] = typer.Option(None, "--input-len", help=_len_help("Prompt tokens.", "input_len")),
    output_len: Optional[int] = typer.Option(None, "--output-len",
                                             help=_len_help("Output tokens per request.", "output_len")),
    concurrency: Optional[int] = typer.Option(None, "--concurrency",
                                              help=_len_help("Requests generated together.", "concurrency")),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed runs (after one warm-up); medians are shown."),
    result_file: Optional[Path] = typer.Option(None, "--result-file", help="Append one JSON line of results."),
) -> None:
    """Engine throughput without HTTP: decode tok/s at batch 1 and output tok/s at a concurrency."""
    with Console(stderr=True).status("bench offline") as status:
        result = run_offline(args, input_len, output_len, concurrency, repeats,
                             progress=lambda text: status.update(f"bench offline: {text}"))
    if result_file is not None:
        write_result(result_file, result)
    print_result(result)


def _has_cuda(device: str) -> bool:
    """Whether the rows run on a CUDA GPU (--device auto: when one is visible)."""
    if device != "auto":
        return device == "cuda"
    import torch  # lazy: keeps dsctl --help fast

    return torch.cuda.is_available()


@bench_app.command("ablation")
@engine_command(*non_server_groups())
def ablation(
    args: EngineArgs,
    input_len: Optional[int] = typer.Option(None, "--input-len", help=_len_help("Prompt tokens.", "input_len")),
    output_len: Optional[int] = typer.Option(None, "--output-len",
                                             help=_len_help("Output tokens per request.", "output_len")),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help=_len_help(
        "Requests generated together for the output tok/s column.", "concurrency")),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed runs per row (medians are shown)."),
    out_dir: Path = typer.Option(Path("bench-ablation"), "--out-dir",
                                 help="Where ablation.jsonl, ablation.png and each row's log go (rewritten)."),
    row_timeout: float = typer.Option(1800.0, "--row-timeout", help="Seconds before a row is stopped (❌)."),
    time_budget: Optional[float] = typer.Option(
        None, "--time-budget", help="Seconds for the whole grid: rows not started by then are ❌, and a running "
        "row is stopped when it is spent (default: no limit)."),
) -> None:
    """SGLang's DeepSeek ablation table on this machine: each optimisation on/off (where its flag exists),
    every row in its own process; runnable, decode tok/s at batch 1, output tok/s at a concurrency."""
    args.validate()
    settings = Settings(input_len, output_len, concurrency, repeats, row_timeout, out_dir, time_budget)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = _has_cuda(args.model.device)
    rows = make_rows(args, cuda=cuda, base_label="baseline")
    console = Console()
    runs = sum(r.refusal is None for r in rows)
    console.print(f"bench ablation: {len(rows)} configurations of {args.model.model} on "
                  f"{'CUDA' if cuda else 'CPU'}, each in its own process ({runs} to start)", markup=False)
    results = run_ablation(rows, settings)
    ablation_report.print_table(results, available_features(), args.model.model, console)
    ablation_report.write_jsonl(out_dir / "ablation.jsonl", results)
    skipped = ablation_report.write_png(out_dir / "ablation.png", results,
                                        ablation_report.title(results, args.model.model))
    console.print(f"wrote {out_dir / 'ablation.jsonl'}" + (f"; PNG skipped: {skipped}" if skipped else
                                                          f" and {out_dir / 'ablation.png'}"), markup=False)


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
    request_file: Optional[Path] = typer.Option(
        None, "--request-file", help="Write one JSON line per request (start, TTFT, latency, tokens, error and the "
        "time of every streamed chunk, seconds), to see where latency tails come from."),
    client_processes: int = typer.Option(
        0, "--client-processes", min=0, help="Processes sending the requests, each with its share of them and of "
        "--max-concurrency (0: one per 64 in flight, at most half the CPUs), so the client keeps up with the server."),
) -> None:
    """Benchmark an OpenAI-compatible server: throughput, TTFT, TPOT, ITL, E2E latency, goodput."""
    from dsctl.bench_serving.main import ServingOptions, run_serving  # lazy: numpy and httpx; keeps dsctl --help fast

    opts = ServingOptions(**{k: v for k, v in locals().items() if k in ServingOptions.__dataclass_fields__})
    run_serving(opts, Console(highlight=False))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
