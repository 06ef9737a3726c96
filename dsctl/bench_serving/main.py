"""`dsctl bench serving` end to end: prompts -> load -> metrics -> table, JSON line, plot.

Random prompts go to /v1/completions as token ids, so the server gets exactly the
lengths asked; chat, or a server that refuses token ids, gets text whose length
was verified with the tokenizer. The tokenizer is --tokenizer, else the one of
--model or of the model the server reports (a registry alias with no checkpoint
here gets dsctl's generated stand-in, the same one a dummy server uses).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape

from dsctl.bench_serving.client import Api, accepts_token_ids, normalize_base_url
from dsctl.bench_serving.datasets import load_requests
from dsctl.bench_serving.metrics import Summary, summarize
from dsctl.bench_serving.plot import _pyplot, write_plot
from dsctl.bench_serving.processes import resolve_processes, run_load
from dsctl.bench_serving.random_prompts import pick_form
from dsctl.bench_serving.report import append_result, client_warnings, length_warnings, record, render, write_requests
from dsctl.bench_serving.runner import Load, first_model_card
from dsctl.bench_serving.server_metrics import accept_length, spec_counts
from dsctl.bench_serving.tokens import TokenCounter, first_tokenizer, load_tokenizer
from engine.errors import DsctlError, UsageError


class BenchFailed(DsctlError):
    """No request of the benchmark succeeded."""

    exit_code = 1


@dataclass
class ServingOptions:
    base_url: str
    model: Optional[str] = None
    endpoint: str = "completions"
    dataset: str = "random"
    dataset_path: Optional[Path] = None
    num_prompts: int = 200
    request_rate: str = "inf"
    max_concurrency: Optional[int] = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 1.0
    sharegpt_output_len: Optional[int] = None
    seed: int = 0
    warmup: int = 0
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    tokenizer: Optional[str] = None
    api_key: Optional[str] = None
    ignore_eos: bool = True
    request_timeout: float = 600.0
    result_file: Optional[Path] = None
    plot: Optional[Path] = None
    request_file: Optional[Path] = None
    client_processes: int = 0  # 0: automatic (processes.client_processes)


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise UsageError(f"--request-rate must be a number or inf, not {text!r}") from None
    if not rate > 0:
        raise UsageError("--request-rate must be > 0 (inf sends every request at once)")
    return rate


def _model_card(opts: ServingOptions, base: str) -> dict:
    """The server's first /v1/models card ({} when --model is given and the listing fails)."""
    try:
        return first_model_card(base, opts.api_key)
    except Exception as exc:
        if opts.model:
            return {}
        raise UsageError(f"cannot list models at {base}/v1/models ({type(exc).__name__}: {exc}); "
                         "pass --model") from None


def _tokenizer(opts: ServingOptions, card: dict) -> Optional[TokenCounter]:
    if opts.tokenizer:
        return load_tokenizer(opts.tokenizer, required=True)
    return first_tokenizer([opts.model, card.get("root"), card.get("id")])


_FORMS = {"ids": "token ids (exact lengths)", "text": "text (lengths verified with the tokenizer)",
          "chat": "chat messages (content lengths verified with the tokenizer)",
          "words": "words (approximate lengths: no tokenizer)", "file": "from the dataset file"}


def _prompt_form(opts: ServingOptions, api: Api, tok: Optional[TokenCounter], console: Console) -> str:
    """How prompts are sent: ids, text, chat or words (random dataset), or file."""
    if opts.dataset != "random":
        return "file"
    form = pick_form(opts.endpoint, tok)
    if form == "ids":
        ok, why = accepts_token_ids(api, [int(tok.ordinary_ids[0])], opts.request_timeout)
        if not ok:
            console.print(f"[yellow]the server refused a token-id prompt ({escape(why)}); sending text whose "
                          "length is verified with the tokenizer instead[/]")
            form = "text"
    return "chat" if form == "text" and opts.endpoint == "chat" else form


def run_serving(opts: ServingOptions, console: Console) -> Summary:
    rate = parse_rate(opts.request_rate)
    if opts.endpoint not in ("completions", "chat"):
        raise UsageError("--endpoint must be completions or chat")
    if opts.plot is not None:
        _pyplot()  # fail before the run, not after it
    base = normalize_base_url(opts.base_url)
    card = _model_card(opts, base)
    api = Api(base, opts.model or card["id"], opts.endpoint, opts.api_key, opts.ignore_eos)
    tok = _tokenizer(opts, card)
    form = _prompt_form(opts, api, tok, console)
    requests = load_requests(opts.dataset, opts.dataset_path, opts.num_prompts, opts.random_input_len,
                             opts.random_output_len, opts.random_range_ratio, opts.seed, tok,
                             opts.sharegpt_output_len, form="text" if form == "chat" else form,
                             add_special_tokens=opts.endpoint == "completions")
    if opts.client_processes < 0:
        raise UsageError("--client-processes must be >= 0 (0: automatic)")
    processes = resolve_processes(opts.client_processes, opts.max_concurrency, len(requests))
    load = Load(rate, opts.max_concurrency, opts.request_timeout, processes)
    console.print(f"{len(requests)} requests ({opts.dataset}) -> {api.url} model={api.model} "
                  f"rate={rate} max_concurrency={opts.max_concurrency or 'none'} client_processes={processes} "
                  f"tokenizer={tok.source if tok else 'none (server usage / estimates)'}", highlight=False)
    console.print(f"prompts: {_FORMS[form]}", highlight=False)
    if opts.warmup:
        warm = [requests[i % len(requests)] for i in range(opts.warmup)]
        results, _ = run_load(api, warm, Load(math.inf, opts.max_concurrency, opts.request_timeout), opts.seed, tok)
        failed = [r for r in results if not r.ok]
        console.print(f"warmup: {len(results) - len(failed)}/{len(results)} ok"
                      + (f" (first error: {failed[0].error})" if failed else ""))
    spec_before = spec_counts(base, opts.api_key)
    cpu: list[float] = []
    results, duration = run_load(api, requests, load, opts.seed, tok, cpu=cpu)
    summary = summarize(results, duration, opts.slo_ttft_ms, opts.slo_tpot_ms)
    summary.client_processes = processes
    summary.client_busy = max(cpu) / duration if cpu and duration > 0 else None
    summary.spec_accept_length = accept_length(spec_before, spec_counts(base, opts.api_key))
    title = f"bench serving: {api.model} @ {base}"
    render(summary, console, title)
    for line in length_warnings(summary, form, opts.ignore_eos) + client_warnings(summary):
        console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    if opts.result_file is not None:
        rec = record(summary, dataclasses.asdict(opts) | {"api_key": None}) | {"prompt_form": form}
        append_result(opts.result_file, rec)
        console.print(f"result appended to {opts.result_file}")
    if opts.request_file is not None:
        write_requests(opts.request_file, results)
        console.print(f"requests written to {opts.request_file}")
    if opts.plot is not None:
        write_plot(results, opts.plot, title)
        console.print(f"plot written to {opts.plot}")
    if summary.completed == 0:
        first = next(iter(summary.errors), "no error recorded")
        raise BenchFailed(f"all {summary.failed} requests failed; first error: {first}")
    return summary
