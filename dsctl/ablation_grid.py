"""The rows of `dsctl bench ablation`: which optimisations each configuration turns on.

Features are the columns of SGLang's DeepSeek ablation table (MLA optimisation,
torch.compile, CUDA graph, radix cache, FlashInfer MLA, NextN, EP-MoE, DP
attention), each tied to the EngineArgs field that switches it. A feature is a
column only when its field exists in EngineArgs today, so the columns of
features still to come appear by themselves when their flags land.

Rows: the configuration as given (engine defaults plus the user's flags), each
available feature flipped on its own, then the seed table's combinations whose
"on" features all exist here. Duplicates are dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

from engine.args import EngineArgs


def _field(name: str):
    return next((f for f in dataclasses.fields(EngineArgs) if f.name == name), None)


def _ep_on(base: EngineArgs) -> int:
    """EP over the tensor-parallel group when there is one, else 2 ranks (fails on one GPU, with the reason)."""
    tp = getattr(base, "tp_size", 1) or 1
    return tp if tp > 1 else 2


def _nextn_on(base: EngineArgs) -> Any:
    choices = _field("speculative_algorithm").metadata.get("choices") or ()
    return "NEXTN" if "NEXTN" in choices or not choices else next(c for c in choices if c)


@dataclass(frozen=True)
class Feature:
    key: str  # JSON key
    name: str  # for labels
    header: str  # column header ("\n" where it breaks)
    field: str  # the EngineArgs field that switches it
    off: Any  # the field's value with the feature off
    on: Union[Any, Callable[[EngineArgs], Any]]  # value (or base -> value) with the feature on
    always_on: bool = False  # what the engine does while the flag does not exist: MLA is always used

    def available(self) -> bool:
        return _field(self.field) is not None

    def is_on(self, args: EngineArgs) -> bool:
        return args.value(self.field) != self.off

    def value(self, on: bool, base: EngineArgs) -> Any:
        if not on:
            return self.off
        if self.is_on(base):
            return getattr(base, self.field)
        return self.on(base) if callable(self.on) else self.on


FEATURES = (
    Feature("mla", "MLA", "MLA", "disable_mla", off=True, on=False, always_on=True),
    Feature("torch_compile", "torch.compile", "torch\ncompile", "enable_torch_compile", off=False, on=True),
    Feature("cuda_graph", "CUDA graph", "CUDA\ngraph", "disable_cuda_graph", off=True, on=False),
    Feature("radix_cache", "radix cache", "radix\ncache", "disable_radix_cache", off=True, on=False),
    Feature("flashinfer_mla", "FlashInfer MLA", "FlashInfer\nMLA", "enable_flashinfer_mla", off=False, on=True),
    Feature("nextn", "NextN", "NextN", "speculative_algorithm", off=None, on=_nextn_on),
    Feature("ep_moe", "EP-MoE", "EP-MoE", "ep_size", off=1, on=_ep_on),
    Feature("dp_attention", "DP attention", "DP\nattention", "enable_dp_attention", off=False, on=True),
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


def available_features() -> list[Feature]:
    return [f for f in FEATURES if f.available()]


def _runnable_here(on: frozenset, features: list[Feature]) -> bool:
    """A seed row fits when every feature it turns on can be turned on here, and every feature that is
    always on here (no flag to turn it off) is on in it."""
    keys = {f.key for f in features}
    fixed_on = {f.key for f in FEATURES if f.always_on and f.key not in keys}
    return all(k in keys or k in fixed_on for k in on) and fixed_on <= on


def _label(state: dict[str, bool], base_state: dict[str, bool], features: list[Feature], base_label: str) -> str:
    changes = [("+" if state[f.key] else "-") + f.name for f in features if state[f.key] != base_state[f.key]]
    return ", ".join(changes) or base_label


def make_rows(base: EngineArgs, base_label: str = "as given") -> list[Row]:
    """The configuration as given, each feature flipped alone, then the seed's combinations (see module doc)."""
    features = available_features()
    base_state = {f.key: f.is_on(base) for f in features}
    states = [dict(base_state)]
    for f in features:
        states.append({**base_state, f.key: not base_state[f.key]})
    for on in SEED_ROWS:
        if _runnable_here(on, features):
            states.append({f.key: f.key in on for f in features})
    rows, seen = [], set()
    for state in states:
        sig = tuple(state[f.key] for f in features)
        if sig in seen:
            continue
        seen.add(sig)
        args = base.replace(**{f.field: f.value(state[f.key], base) for f in features})
        rows.append(Row(_label(state, base_state, features, base_label), state, args))
    return rows
