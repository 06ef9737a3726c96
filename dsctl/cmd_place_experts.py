"""`dsctl place-experts`: plan where each routed expert lives under expert parallelism, from recorded routing
counts, with redundant copies of the hottest experts.

    dsctl serve ... --ep 8 --record-expert-load          # serve a representative load, then
    curl -s localhost:30000/expert_load > load.json
    dsctl place-experts --load load.json --ep 8 --redundant 32 --output placement.json
    dsctl serve ... --ep 8 --expert-placement placement.json

Prints, per MoE layer, how uneven the EP ranks' loads are under the plain layout and under the plan (the
busiest rank's tokens over the mean rank's, each expert's tokens split evenly over its copies), and writes the
placement file (engine/distributed/expert_placement.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from engine.errors import UsageError


def _read_load(path: Path) -> dict[int, list[int]]:
    try:
        data = json.loads(path.read_text())
        layers = {int(k): [int(x) for x in v["logical"]] for k, v in data["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--load {path}: not a routing-count file (GET /expert_load of a server started with "
                         f"--record-expert-load): {exc!r}") from None
    if not layers:
        raise UsageError(f"--load {path}: no MoE layer in it")
    return layers


def place_experts(
    load: Path = typer.Option(..., "--load", help="Routing counts: the JSON of a server's GET /expert_load "
                              "(started with --record-expert-load) under a representative load."),
    ep: int = typer.Option(..., "--ep", help="Expert-parallel size the placement is for (the server's --ep)."),
    redundant: int = typer.Option(0, "--redundant", help="Extra expert copies per MoE layer, given to the hottest "
                                  "experts; experts + redundant must be a multiple of --ep."),
    output: Path = typer.Option(..., "--output", "-o", help="Placement file to write (--expert-placement)."),
) -> None:
    """Plan the routed experts' placement over EP ranks from recorded routing counts."""
    # lazy: the placement module and the model config it reads (dataclasses); keeps dsctl --help fast
    from engine.distributed.expert_placement import expected_rank_loads, imbalance, plan_placement

    if ep < 2:
        raise UsageError("--ep must be at least 2: a placement spreads experts over expert-parallel ranks")
    counts = _read_load(load)
    placement = plan_placement(counts, ep, redundant)
    num = placement.num_experts
    if num % ep:
        raise UsageError(f"{num} experts do not split over --ep {ep}")
    table = Table(title=f"EP {ep}, {num} experts + {redundant} redundant per layer: busiest rank / mean rank")
    for col in ("layer", "tokens", "plain layout", "planned"):
        table.add_column(col, justify="right")
    before, after = [], []
    for layer, load_e in sorted(counts.items()):
        plain = expected_rank_loads(tuple(range(num)), load_e, ep)
        planned = expected_rank_loads(placement.slots(layer), load_e, ep)
        before.append(imbalance(plain))
        after.append(imbalance(planned))
        table.add_row(str(layer), str(sum(load_e)), f"{before[-1]:.3f}", f"{after[-1]:.3f}")
    console = Console()
    console.print(table)
    placement.save(output)
    console.print(f"mean over {len(counts)} layers: {sum(before) / len(before):.3f} -> {sum(after) / len(after):.3f}; "
                  f"wrote {output} (serve with --expert-placement {output} --ep {ep})")


def register(app: typer.Typer) -> None:
    app.command("place-experts")(place_experts)
