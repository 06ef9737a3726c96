"""Where each routed expert lives under expert parallelism: a static placement with redundant experts (no torch).

Without a placement, EP rank r holds logical experts [r * E / ep, (r + 1) * E / ep). A placement
(`--expert-placement FILE`, written by `dsctl place-experts` from the routing counts a server recorded with
`--record-expert-load`) gives each MoE layer its own list of physical expert slots, `slots[p]` = the logical
expert slot p holds, E + R slots in all (R redundant: the hottest experts get more than one copy), rank r
holding slots [r * S, (r + 1) * S) with S = (E + R) / ep. The router still picks logical experts; each pick
goes to one of its expert's copies (engine/model/moe.py's `replica_tables`: row and column of the pick choose
among them, so that a hot expert's tokens spread over its copies), and from there on the layer works on slot ids as it works on
expert ids without a placement (engine/model/moe.py).

`plan_placement` is the balancing rule (in the spirit of DeepSeek's EPLB): copies go one at a time to the
expert with the highest load per copy, then the copies, heaviest first, to the least loaded rank with a free
slot that does not hold that expert yet.

The file (JSON): {"format": FORMAT, "ep_size": ep, "num_experts": E, "layers": {"<layer>": [slot -> logical
expert, ...]}}, layers by their checkpoint index (the MTP layer: num_hidden_layers); a MoE layer the file does
not name keeps the plain layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from engine.checkpoint.config import ModelConfig
from engine.errors import UsageError

FORMAT = "dsctl-expert-placement/1"


@dataclass(frozen=True)
class ExpertPlacement:
    ep_size: int
    num_experts: int  # logical routed experts per layer
    layers: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> logical expert of each slot

    def slots(self, layer: int) -> Optional[tuple[int, ...]]:
        """The layer's slot -> logical expert list, or None (the plain layout)."""
        return self.layers.get(layer)

    def to_json(self) -> dict:
        return {"format": FORMAT, "ep_size": self.ep_size, "num_experts": self.num_experts,
                "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}

    def redundant(self) -> int:
        """The most extra slots (copies beyond one per expert) of any placed layer."""
        return max((len(v) - self.num_experts for v in self.layers.values()), default=0)

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")


def load_placement(path: Path | str) -> ExpertPlacement:
    """Read a placement file; UsageError naming what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--expert-placement {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"--expert-placement {path}: not a placement file (want \"format\": \"{FORMAT}\"; "
                         "write one with dsctl place-experts)")
    try:
        layers = {int(k): tuple(int(e) for e in v) for k, v in data["layers"].items()}
        placement = ExpertPlacement(int(data["ep_size"]), int(data["num_experts"]), layers)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--expert-placement {path}: malformed ({exc!r})") from None
    for layer, slots in placement.layers.items():
        _check_slots(slots, placement.num_experts, placement.ep_size, f"--expert-placement {path}: layer {layer}")
    return placement


def _check_slots(slots: Sequence[int], num_experts: int, ep_size: int, where: str) -> None:
    if len(slots) < num_experts or len(slots) % ep_size:
        raise UsageError(f"{where}: {len(slots)} slots; want at least the {num_experts} experts and a multiple of "
                         f"the EP size {ep_size}")
    bad = [e for e in slots if not 0 <= e < num_experts]
    if bad:
        raise UsageError(f"{where}: expert ids {sorted(set(bad))[:5]} are outside [0, {num_experts})")
    missing = sorted(set(range(num_experts)) - set(slots))
    if missing:
        raise UsageError(f"{where}: experts {missing[:8]}{' ...' if len(missing) > 8 else ''} have no slot")


def check_placement(placement: ExpertPlacement, ep_size: int, num_experts: int, moe_layers: Sequence[int]) -> None:
    """At start-up, before any weight is read: the placement fits this model and layout (UsageError if not)."""
    if ep_size <= 1:
        raise UsageError("--expert-placement places experts over expert-parallel ranks: add --ep-size equal to "
                         "--tp (or --enable-ep-moe), or drop the flag")
    if placement.ep_size != ep_size:
        raise UsageError(f"--expert-placement was planned for EP {placement.ep_size}, this layout has EP {ep_size}: "
                         f"plan again with dsctl place-experts --ep {ep_size}")
    if placement.num_experts != num_experts:
        raise UsageError(f"--expert-placement is for {placement.num_experts} routed experts, this model has "
                         f"{num_experts}")
    unknown = sorted(set(placement.layers) - set(moe_layers))
    if unknown:
        raise UsageError(f"--expert-placement names layers {unknown[:8]} that are not MoE layers of this model "
                         f"(its MoE layers: {_ranges(moe_layers)})")


def placement_for(path: Path | str, cfg: ModelConfig, ep_size: int) -> ExpertPlacement:
    """--expert-placement for this model (its whole config: the MTP layer is layer num_hidden_layers) and EP
    size: read and checked (UsageError with the reason)."""
    placement = load_placement(path)
    moe_layers = [i for i in range(cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0))
                  if cfg.is_moe_layer(i)]
    check_placement(placement, ep_size, cfg.n_routed_experts, moe_layers)
    return placement


def _ranges(layers: Sequence[int]) -> str:
    layers = sorted(layers)
    return f"{layers[0]}..{layers[-1]}" if layers else "none"


def plan_layer(load: Sequence[float], ep_size: int, redundant: int) -> tuple[int, ...]:
    """One layer's slots for per-expert `load` (token counts) over ep_size ranks with `redundant` extra copies.
    Each expert keeps at least one slot and at most one per rank."""
    e = len(load)
    if (e + redundant) % ep_size:
        raise UsageError(f"{e} experts + {redundant} redundant do not split over {ep_size} ranks: use a redundant "
                         f"count that makes the sum a multiple of {ep_size}")
    if redundant > e * (ep_size - 1):
        raise UsageError(f"{redundant} redundant copies: at most {e * (ep_size - 1)} fit with one copy per rank")
    w = [float(x) + 1e-9 for x in load]  # an expert never routed to still gets its slot
    copies = [1] * e
    for _ in range(redundant):
        hot = max((i for i in range(e) if copies[i] < ep_size), key=lambda i: (w[i] / copies[i], -i))
        copies[hot] += 1
    per_rank = (e + redundant) // ep_size
    items = sorted(((w[i] / copies[i], i) for i in range(e) for _ in range(copies[i])), key=lambda t: (-t[0], t[1]))
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    loads = [0.0] * ep_size
    for share, expert in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < per_rank]
        fresh = [r for r in free if expert not in ranks[r]] or free
        r = min(fresh, key=lambda r: (loads[r], r))
        ranks[r].append(expert)
        loads[r] += share
    return tuple(x for rank in ranks for x in sorted(rank))


def plan_placement(load: Mapping[int, Sequence[float]], ep_size: int, redundant: int) -> ExpertPlacement:
    """A placement for every layer of `load` (layer -> per-logical-expert token counts)."""
    sizes = {len(v) for v in load.values()}
    if len(sizes) != 1:
        raise UsageError(f"the load's layers have different expert counts {sorted(sizes)}")
    return ExpertPlacement(ep_size, sizes.pop(), {k: plan_layer(v, ep_size, redundant) for k, v in load.items()})


def rank_loads(slots: Sequence[int], slot_load: Sequence[float], ep_size: int) -> list[float]:
    """Per-rank sums of per-slot loads."""
    per = len(slots) // ep_size
    return [sum(slot_load[r * per:(r + 1) * per]) for r in range(ep_size)]


def imbalance(loads: Sequence[float]) -> float:
    """The busiest rank's load over the mean rank's (1.0: balanced, or nothing routed)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def expected_rank_loads(slots: Sequence[int], load: Sequence[float], ep_size: int) -> list[float]:
    """Per-rank load a placement gives when each expert's load splits evenly over its copies."""
    copies = [0] * len(load)
    for e in slots:
        copies[e] += 1
    return rank_loads(slots, [load[e] / copies[e] for e in slots], ep_size)
