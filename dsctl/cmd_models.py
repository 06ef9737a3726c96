"""`dsctl models`: list the registry (alias, hub repo id, shape summary)."""

from __future__ import annotations

import typer


def models() -> None:
    from rich.console import Console
    from rich.table import Table

    from engine.config import parse_config
    from engine.models import MODELS

    table = Table(title="Models dsctl knows")
    for col in ("alias", "hub repo id"):
        table.add_column(col, no_wrap=True)
    for col in ("layers", "hidden", "experts (top-k)", "weights", "notes"):
        table.add_column(col)
    for entry in MODELS.values():
        cfg = parse_config(entry.config_dict())
        experts = f"{cfg.n_routed_experts} ({cfg.num_experts_per_tok})" if cfg.n_routed_experts else "-"
        table.add_row(entry.alias, entry.repo_id or "(built in)", str(cfg.num_hidden_layers), str(cfg.hidden_size),
                      experts, "fp8 block" if cfg.fp8 else cfg.torch_dtype, entry.description)
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("models", help="List the models dsctl knows (aliases, hub ids, shapes).")(models)
