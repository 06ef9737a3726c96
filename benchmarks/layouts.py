"""Parallel layouts by short name for the multi-GPU benchmarks: tp<N>[-dp<D>][-ep<N>].

    tp1, tp2 (tensor parallel), tp2-dp2 (+ DP attention, 2 groups), tp2-ep2 (+ expert parallel MoE),
    tp2-ep2-a2a (expert parallel by all-to-all: --moe-a2a-backend torch), a `tbo` part for two-batch overlap
    (`tbo<N>`: from N tokens, --two-batch-overlap-min-tokens; e.g. tp2-dp2-ep2-a2a-tbo, tp2-ep2-tbo2)

`engine_flags(name)` gives EngineArgs field values, `cli_flags(name)` the `dsctl` options,
`split(name)` the (tp, dp) that the per-GPU bytes floor (engine/distributed/step_floor.py) takes.
`python3 benchmarks/layouts.py NAME` prints the CLI flags (for shell scripts).
"""

from __future__ import annotations

import sys


def engine_flags(name: str) -> dict:
    flags = {}
    for part in name.split("-"):
        if part == "a2a":  # expert parallel by all-to-all (with an ep part)
            flags["moe_a2a_backend"] = "torch"
            continue
        if part.startswith("tbo") and (part == "tbo" or part[3:].isdigit()):
            flags["enable_two_batch_overlap"] = True
            if part[3:]:
                flags["two_batch_overlap_min_tokens"] = int(part[3:])
            continue
        kind, n = part[:2], part[2:]
        if not n.isdigit() or kind not in ("tp", "dp", "ep"):
            raise ValueError(f"bad layout part {part!r} in {name!r} (use e.g. tp2, tp2-dp2, tp2-ep2, tp2-ep2-a2a)")
        if kind == "tp":
            flags["tp_size"] = int(n)
        elif kind == "dp":
            flags.update(enable_dp_attention=True, dp_size=int(n))
        else:
            flags["ep_size"] = int(n)
    return flags


def cli_flags(name: str) -> list[str]:
    out = []
    for key, value in engine_flags(name).items():
        flag = "--" + key.replace("_size", "").replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def split(name: str) -> tuple[int, int]:
    f = engine_flags(name)
    return f.get("tp_size", 1), f.get("dp_size", 1)


if __name__ == "__main__":
    print(" ".join(cli_flags(sys.argv[1])))
