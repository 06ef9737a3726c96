"""`dsctl models`: list the registry (alias, hub repo id, shape summary).

Three layouts, widest first (dsctl/tables.py picks the one that fits): one column
per field; alias + repo id + one wrapping "shape and notes" column; and, on narrow
terminals (80 columns), alias + one wrapping column holding the repo id, the shape
and the notes on separate lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import typer
from rich.console import Console
from rich.table import Table

from dsctl.tables import print_fitting


@dataclass
class _Row:
    alias: str
    repo: str
    layers: str
    hidden: str
    experts: str
    weights: str
    notes: str

    @property
    def shape(self) -> str:
        experts = self.experts.replace(" (", " experts (", 1) if self.experts != "-" else "dense"
        return f"{self.layers} layers, hidden {self.hidden}, {experts}, {self.weights}"


def _rows() -> list[_Row]:
    from engine.checkpoint.config import parse_config  # lazy: ~7 ms of dataclasses; keeps dsctl --help fast
    from engine.checkpoint.registry import MODELS  # lazy: ~7 ms of dataclasses; keeps dsctl --help fast

    rows = []
    for entry in MODELS.values():
        cfg = parse_config(entry.config_dict())
        experts = f"{cfg.n_routed_experts} (top-{cfg.num_experts_per_tok})" if cfg.n_routed_experts else "-"
        rows.append(_Row(entry.alias, entry.repo_id or "(built in)", str(cfg.num_hidden_layers),
                         str(cfg.hidden_size), experts, "fp8 block" if cfg.fp8 else cfg.torch_dtype,
                         entry.description))
    return rows


def _layouts(rows: list[_Row]) -> list:
    title = "Models dsctl knows"
    wide = Table(title=title)
    for col in ("alias", "hub repo id", "layers", "hidden", "experts", "weights"):
        wide.add_column(col, no_wrap=True)
    wide.add_column("notes")
    for r in rows:
        wide.add_row(r.alias, r.repo, r.layers, r.hidden, r.experts, r.weights, r.notes)

    medium = Table(title=title)
    medium.add_column("alias", no_wrap=True)
    medium.add_column("hub repo id", no_wrap=True)
    medium.add_column("shape and notes")
    for r in rows:
        medium.add_row(r.alias, r.repo, f"{r.shape}; {r.notes}")

    narrow = Table(title=title, show_lines=True)
    narrow.add_column("alias", no_wrap=True)
    narrow.add_column("hub repo id, shape, notes")
    for r in rows:
        narrow.add_row(r.alias, f"{r.repo}\n{r.shape}\n{r.notes}")
    return [wide, medium, narrow]


def _fit_layouts() -> list:
    from engine.memory.fit import MACHINES, fit_rows  # lazy: the memory plan's modules; keeps dsctl --help fast

    rows = fit_rows()
    title = "KV tokens per DP group at the default flags (bf16 KV cache; no: does not fit)"
    wide, narrow = Table(title=title), Table(title=title, show_lines=True)
    for col in ("models", "weights", "layout"):
        wide.add_column(col, no_wrap=col != "models")
    narrow.add_column("models, weights, layout")
    for table in (wide, narrow):
        for label, _, _ in MACHINES:
            table.add_column(label.replace(" 1", "\n1").replace(" 8", "\n8"), no_wrap=True, justify="right")
    for r in rows:
        wide.add_row(r.models, r.quant, r.layout, *r.cells)
        narrow.add_row(f"{r.models}\n{r.quant}, {r.layout}", *r.cells)
    return [wide, narrow]


def models(fit: bool = typer.Option(False, "--fit", help="Show which layouts of each model fit 8 x H100, 8 x H200 "
                                    "and 4 x H200, with the KV tokens per DP group (the memory plan).")) -> None:
    print_fitting(Console(), _fit_layouts() if fit else _layouts(_rows()))


def register(app: typer.Typer) -> None:
    app.command("models", help="List the models dsctl knows (aliases, hub ids, shapes); --fit: which layouts fit "
                "which GPUs.")(models)
