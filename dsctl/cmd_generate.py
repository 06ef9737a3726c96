"""`dsctl generate`: offline generation from one or more prompts through the Engine."""

from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.console import Console

from dsctl.flags import engine_command, non_server_groups
from engine.args import EngineArgs


@engine_command(*non_server_groups())
def generate(
    args: EngineArgs,
    prompt: List[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch."),
    max_new_tokens: int = typer.Option(32, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(-1, help="Sample from the k most likely tokens (-1 = off)."),
    min_p: float = typer.Option(0.0, help="Drop tokens below min_p x the top probability."),
    sample_seed: Optional[int] = typer.Option(None, "--sample-seed", help="Seed for sampling."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string; repeatable."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message with the chat template."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
) -> None:
    from engine.runtime.offline import open_engine  # lazy: imports torch; keeps dsctl --help fast
    from engine.sampling import SamplingParams  # lazy: imports torch; keeps dsctl --help fast

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, seed=sample_seed, stop=list(stop)).validate()
    engine = open_engine(args)  # one process, or one per rank with --tp N
    try:
        if chat:
            ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompt]
            outs = engine.generate(input_ids=ids, sampling_params=params)
        else:
            outs = engine.generate(list(prompt), params)
    finally:
        engine.close()
    console = Console()
    for p, o in zip(prompt, outs):
        if json_out:
            print(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}))
        else:
            console.print(f"[bold]{p}[/bold]", end="")
            console.print(o.text, markup=False, highlight=False)
            console.print(f"[dim]({o.completion_tokens} tokens, finish: {o.finish_reason})[/dim]")


def register(app: typer.Typer) -> None:
    app.command("generate", help="Generate text offline from one or more prompts.")(generate)
