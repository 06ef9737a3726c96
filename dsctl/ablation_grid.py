"""The rows of `dsctl bench ablation`: which optimisations each configuration turns on.

Features are the columns of SGLang's DeepSeek ablation table (MLA optimisation,
torch.compile, CUDA graph, radix cache, FlashInfer MLA, NextN, EP-MoE, DP
attention), each tied to the engine flag (EngineArgs field) that switches it.
`FEATURES` lists them all; a feature whose engine support has not landed yet has
`landed=False` and is no column and no row. When it lands, flipping that one word
adds its column and every seed row that uses it (tests/bench/test_ablation.py
checks that every landed feature names a real EngineArgs field).

Rows: the configuration as given (engine defaults plus the user's flags), each
landed feature flipped on its own, then the seed table's combinations whose "on"
features have all landed. Duplicates are dropped. Some rows are refused (❌ with the
reason) without starting a process:
- on a CPU, a row that turns on a feature that needs a CUDA GPU (they are off in the
  base row there);
- at --tp 1, a row with EP-MoE or DP attention on: they split work over the ranks, and
  with one rank the engine runs exactly what it runs without them (a figure would be a
  copy of another row's). Run the ablation with --tp N (N GPUs, or N CPU processes with
  --device cpu) to measure them; each row then starts its N ranks.
Turning MLA off (--disable-mla) also turns off FlashInfer MLA, which cannot read its
per-head cache (the row's label and columns say so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from engine.args import GROUPS, EngineArgs, fields_in_groups


def engine_field(name: str) -> Optional[dataclasses.Field]:
    """The EngineArgs field (in any group) called `name`, or None."""
    return next((f for _, f in fields_in_groups(tuple(GROUPS)) if f.name == name), None)


@dataclass(frozen=True)
class Feature:
    key: str  # JSON key
    name: str  # for labels and reasons
    header: str  # column header ("\n" where it breaks)
    field: str  # the EngineArgs field that switches it
    off: Any  # the field's value with the feature off
    on: Any  # the field's value with the feature on
    landed: bool = True  # False: the engine has no such feature yet (no column, no row)
    needs_cuda: bool = False  # cannot be on without a CUDA GPU
    always_on: bool = False  # what the engine does while it has no flag for it (MLA: always used)
    needs_ranks: bool = False  # splits work over TP ranks: the same as off at --tp 1
    off_flags: tuple = ()  # (field, value) pairs also set when the feature is off (--ep-size 1 ...)
    off_turns_off: tuple = ()  # feature keys the engine cannot run while this one is off

    def available(self) -> bool:
        return self.landed and engine_field(self.field) is not None

    def is_on(self, args: EngineArgs) -> bool:
        return args.value(self.field) != self.off or any(args.value(f) != v for f, v in self.off_flags)

    def flags(self, on: bool, base: EngineArgs) -> dict[str, Any]:
        """The EngineArgs fields (flag names) this feature sets in a row."""
        if on:
            return {} if self.is_on(base) else {self.field: self.on}
        return {self.field: self.off, **dict(self.off_flags)}


FEATURES = (
    Feature("mla", "MLA", "MLA", "disable_mla", off=True, on=False, always_on=True,
            off_turns_off=("flashinfer_mla", "nextn")),
    Feature("torch_compile", "torch.compile", "torch\ncompile", "enable_torch_compile", False, True, needs_cuda=True),
    Feature("cuda_graph", "CUDA graph", "CUDA\ngraph", "disable_cuda_graph", off=True, on=False, needs_cuda=True),
    Feature("radix_cache", "radix cache", "radix\ncache", "disable_radix_cache", off=True, on=False),
    Feature("flashinfer_mla", "FlashInfer MLA", "FlashInfer\nMLA", "enable_flashinfer_mla", False, True,
            needs_cuda=True),
    Feature("nextn", "NextN", "NextN", "speculative_algorithm", off=None, on="NEXTN"),
    Feature("ep_moe", "EP-MoE", "EP-MoE", "enable_ep_moe", off=False, on=True, needs_ranks=True,
            off_flags=(("ep_size", 1),)),
    Feature("dp_attention", "DP attention", "DP\nattention", "enable_dp_attention", False, True, needs_ranks=True,
            off_flags=(("dp_size", 1),)),
)

# SGLang's ablation table (DeepSeek-R1, the seed), one row per line: the features it turns on.
# MLA is on in every row of it; features not named are off.
_SEED_ON = (
    "torch_compile cuda_graph radix_cache",
    "torch_compile cuda_graph radix_cache flashinfer_mla",
    "torch_compile cuda_graph radix_cache flashinfer_mla dp_attention",
    "torch_compile cuda_graph radix_cache flashinfer_mla ep_moe dp_attention",
    "torch_compile cuda_graph radix_cache ep_moe",
    "torch_compile radix_cache ep_moe",
    "cuda_graph radix_cache ep_moe",
    "cuda_graph radix_cache flashinfer_mla ep_moe",
    "nextn ep_moe",
    "cuda_graph nextn ep_moe",
    "torch_compile cuda_graph nextn ep_moe",
    "cuda_graph radix_cache ep_moe dp_attention",
    "torch_compile cuda_graph radix_cache ep_moe dp_attention",
    "cuda_graph radix_cache flashinfer_mla ep_moe dp_attention",
    "cuda_graph radix_cache nextn ep_moe dp_attention",
    "nextn dp_attention",
)
SEED_ROWS = tuple(frozenset(("mla " + line).split()) for line in _SEED_ON)


@dataclass
class Row:
    label: str
    state: dict[str, bool]  # feature key -> on, for every available feature
    args: EngineArgs
    refusal: Optional[str] = None  # why it cannot run here (known before starting it)


def available_features(features: tuple[Feature, ...] = FEATURES) -> list[Feature]:
    return [f for f in features if f.available()]


def _fits(on: frozenset, features: list[Feature], all_features: tuple[Feature, ...]) -> bool:
    """A seed row fits when every feature it turns on is available here, and every feature that is
    always on here (no flag to turn it off) is on in it."""
    keys = {f.key for f in features}
    fixed_on = {f.key for f in all_features if f.always_on and f.key not in keys}
    return all(k in keys or k in fixed_on for k in on) and fixed_on <= on


def _label(state: dict[str, bool], base_state: dict[str, bool], features: list[Feature], base_label: str) -> str:
    changes = [("+" if state[f.key] else "-") + f.name for f in features if state[f.key] != base_state[f.key]]
    return ", ".join(changes) or base_label


def _refusal(state: dict[str, bool], features: list[Feature], cuda: bool, tp: int) -> Optional[str]:
    """One reason per kind of refused row (one footnote each: the row's columns say which features)."""
    if not cuda and any(f.needs_cuda and state[f.key] for f in features):
        return f"needs a CUDA GPU ({', '.join(f.name for f in features if f.needs_cuda)}: CUDA only)"
    if tp == 1 and any(f.needs_ranks and state[f.key] for f in features):
        names = " and ".join(f.name for f in features if f.needs_ranks)
        return f"needs --tp > 1 ({names} split work over ranks; at --tp 1 they run what the row without them runs)"
    return None


def _constrain(state: dict[str, bool], features: list[Feature]) -> dict[str, bool]:
    """Turn off what a feature that is off rules out (MLA off: no FlashInfer MLA)."""
    out = dict(state)
    for f in features:
        if not out[f.key]:
            out.update({k: False for k in f.off_turns_off if k in out})
    return out


def make_rows(base: EngineArgs, cuda: bool = True, base_label: str = "as given",
              features: tuple[Feature, ...] = FEATURES) -> list[Row]:
    """The configuration as given, each feature flipped alone, then the seed's combinations (see module doc).
    cuda=False: the machine has no CUDA GPU."""
    avail = available_features(features)
    if not cuda:
        base = base.replace(**{f.field: f.off for f in avail if f.needs_cuda})
    base_state = _constrain({f.key: f.is_on(base) for f in avail}, avail)
    base = base.replace(**{k: v for f in avail if not base_state[f.key] for k, v in f.flags(False, base).items()})
    states = [dict(base_state)]
    for f in avail:
        states.append(_constrain({**base_state, f.key: not base_state[f.key]}, avail))
    for on in SEED_ROWS:
        if _fits(on, avail, features):
            states.append({f.key: f.key in on for f in avail})
    rows, seen = [], set()
    tp = base.parallel.tp_size
    for state in states:
        sig = tuple(state[f.key] for f in avail)
        if sig in seen:
            continue
        seen.add(sig)
        flags: dict[str, Any] = {}
        for f in avail:
            flags.update(f.flags(state[f.key], base))
        rows.append(Row(_label(state, base_state, avail, base_label), state, base.replace(**flags),
                        _refusal(state, avail, cuda, tp)))
    return rows
