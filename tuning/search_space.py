"""Launch-config search space: the grid, pruning before any launch, and local neighbourhoods.

A config is a dict of BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages (the keys of
kernels/tuned_configs.CONFIG_KEYS); fused-MoE configs may add `<KEY>_DOWN` entries that apply to
the down-projection GEMM only (BLOCK_SIZE_M is shared by both GEMMs), block-GEMM configs
`CUBLAS: 1` (cuBLASLt's block-scaled FP8 GEMM where available).

Pruning, in order, with a reason for every dropped config:
- block shape: with 128 x 128 FP8 weight blocks a K tile must divide the 128-wide scale group
  (the kernels read one scale per K tile), and an N tile must divide the group or be a multiple
  of it; tiles larger than the (power-of-two rounded) matrix are waste.
- resources: shared memory of the software pipeline (num_stages copies of the A and B tiles,
  B twice for the gated gate_up GEMM) must fit the device's per-block limit, and the float32
  accumulators (twice for gated) must fit in 128 registers per thread (more spills).
- batch size: BLOCK_SIZE_M far beyond the rows one tile can get (GEMM: M; fused MoE: the tokens
  per expert, M * top_k / E) only pads; for the GEMM, GROUP_SIZE_M values at or beyond the
  number of row tiles launch the same program order as a smaller value.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from kernels.int4 import INT4_GROUP
from kernels.w4a8_gemm import swapped

KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
DOWN_KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
MAX_ACC_REGS = 128  # float32 accumulator registers per thread before the kernel spills


@dataclass(frozen=True)
class Grid:
    """Values of each key. FULL is the grid SGLang's exhaustive tuner walks."""

    block_m: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_n: tuple[int, ...] = (32, 64, 128, 256)
    block_k: tuple[int, ...] = (64, 128, 256)
    group_m: tuple[int, ...] = (1, 16, 32, 64)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)

    def configs(self) -> list[dict]:
        return [dict(zip(KEYS, values)) for values in itertools.product(
            self.block_m, self.block_n, self.block_k, self.group_m, self.num_warps, self.num_stages)]

    def size(self) -> int:
        return (len(self.block_m) * len(self.block_n) * len(self.block_k) * len(self.group_m)
                * len(self.num_warps) * len(self.num_stages))


FULL = Grid()
# First stage of the staged search: the tile shape, warps and two pipeline depths; GROUP_SIZE_M
# and the other depths are searched around the best tiles afterwards (neighbours()).
COARSE = Grid(group_m=(1,), num_stages=(3, 4))
# A handful of configs, for tests and smoke runs under the Triton interpreter (`--grid tiny`).
TINY_COARSE = Grid(block_m=(16,), block_n=(64, 128), block_k=(128,), group_m=(1,), num_warps=(4,), num_stages=(2,))
TINY_FULL = Grid(block_m=(16, 32), block_n=(64, 128), block_k=(128,), group_m=(1,), num_warps=(4,), num_stages=(2, 3))
# --grid NAME -> (stage-1 grid, full grid for refinement and --exhaustive)
GRIDS = {"staged": (COARSE, FULL), "tiny": (TINY_COARSE, TINY_FULL)}


@dataclass(frozen=True)
class Limits:
    """What one thread block may use on the device (default: Hopper, H100 / H200)."""

    smem_bytes: int = 232448  # 227 KB opt-in shared memory per block (sm_90)
    max_acc_regs: int = MAX_ACC_REGS

    @classmethod
    def for_device(cls, device=None) -> "Limits":
        if not torch.cuda.is_available():
            return cls()
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if not smem:
            smem = {9: 232448, 8: 166912 if props.minor == 0 else 101376}.get(props.major, 101376)
        return cls(smem_bytes=int(smem))


@dataclass(frozen=True)
class GemmKind:
    """One GEMM as the search space sees it: operand sizes, gating, the problem's N and K."""

    n: int
    k: int
    a_bytes: int = 1  # 1 for FP8 activations, 2 for bf16
    b_bytes: int = 1
    gated: bool = False  # gate and up tiles side by side (fused MoE gate_up)
    block_shape: Optional[tuple[int, int]] = (128, 128)
    whole_groups: bool = False  # K tiles may also be whole scale groups (the swapped W4AFP8 kernel's 64+ row tiles)


def _next_pow2(x: float) -> int:
    v = 1
    while v < x:
        v *= 2
    return v


def smem_bytes(cfg: dict, kind: GemmKind) -> int:
    a = cfg["BLOCK_SIZE_M"] * cfg["BLOCK_SIZE_K"] * kind.a_bytes
    b = cfg["BLOCK_SIZE_K"] * cfg["BLOCK_SIZE_N"] * kind.b_bytes * (2 if kind.gated else 1)
    return cfg["num_stages"] * (a + b)


def acc_regs(cfg: dict, kind: GemmKind) -> float:
    return cfg["BLOCK_SIZE_M"] * cfg["BLOCK_SIZE_N"] * (2 if kind.gated else 1) / (32 * cfg["num_warps"])


def static_reason(cfg: dict, kind: GemmKind, limits: Limits) -> Optional[str]:
    """Why `cfg` cannot run well on `kind` whatever the batch size (None: keep it)."""
    bn, bk = cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    if kind.block_shape is not None:
        qn, qk = kind.block_shape
        several = kind.whole_groups and swapped(cfg, qk)
        if several and bk < qk:
            return "same K step"  # the swapped kernel steps whole groups: as BLOCK_SIZE_K = the group
        if qk % bk and not (several and bk % qk == 0):
            return "block shape"  # a K tile would straddle two scale groups
        if qn % bn and bn % qn:
            return "block shape"
    if bn > max(16, _next_pow2(kind.n)) or bk > max(16, _next_pow2(kind.k)):
        return "tile > matrix"
    if smem_bytes(cfg, kind) > limits.smem_bytes:
        return "shared memory"
    if acc_regs(cfg, kind) > limits.max_acc_regs:
        return "registers"
    return None


def moe_kinds(n: int, k: int, dtype: str, block_shape) -> tuple[GemmKind, GemmKind]:
    """(gate_up, down) GEMMs of a fused-MoE layer: gate_up [2N, K] gated, down [K, N]. w4afp8 (INT4 weights,
    kernels/fused_moe_w4a8.py): a K tile must divide the 128-wide INT4 group (min(128, N) for the down GEMM), or,
    on tiles of 64+ weight rows (the swapped kernel), be whole groups; the packed B tile is unpacked to FP8
    before the dot, so it is counted at one byte per weight."""
    if dtype == "w4afp8":
        up = GemmKind(n=n, k=k, a_bytes=1, b_bytes=1, gated=True, block_shape=(1, INT4_GROUP), whole_groups=True)
        return up, GemmKind(n=k, k=n, a_bytes=1, b_bytes=1, block_shape=(1, min(INT4_GROUP, n)), whole_groups=True)
    nbytes = 1 if dtype == "fp8_w8a8" else 2
    up = GemmKind(n=n, k=k, a_bytes=nbytes, b_bytes=nbytes, gated=True, block_shape=block_shape)
    down = GemmKind(n=k, k=n, a_bytes=nbytes, b_bytes=nbytes, gated=False, block_shape=block_shape)
    return up, down


def down_part(cfg: dict) -> dict:
    """The config the down GEMM runs: `<KEY>_DOWN` entries override <KEY>."""
    out = {k: v for k, v in cfg.items() if not k.endswith("_DOWN")}
    out.update({k[:-5]: v for k, v in cfg.items() if k.endswith("_DOWN")})
    return out


def up_part(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.endswith("_DOWN")}


def moe_static_reason(cfg: dict, kinds: tuple[GemmKind, GemmKind], limits: Limits) -> Optional[str]:
    return static_reason(up_part(cfg), kinds[0], limits) or static_reason(down_part(cfg), kinds[1], limits)


def moe_rows_cap(m: int, top_k: int, experts: int) -> int:
    """Largest useful BLOCK_SIZE_M for M tokens: 4x the (power-of-two) mean tokens per expert, >= 16.

    Routing is uneven (hot experts get a few times the mean), and wgmma prefers 64-row tiles,
    so the cap is generous; the exhaustive comparison checks it (docs/perf.md, "Kernel config tuning")."""
    per_expert = m * top_k / max(experts, 1)
    return max(16, 4 * _next_pow2(per_expert))


def gemm_rows_cap(m: int) -> int:
    return max(16, _next_pow2(m))


def batch_reason_moe(cfg: dict, m: int, top_k: int, experts: int) -> Optional[str]:
    if cfg["BLOCK_SIZE_M"] > moe_rows_cap(m, top_k, experts):
        return "BLOCK_SIZE_M > rows"
    return None


def batch_reason_gemm(cfg: dict, m: int) -> Optional[str]:
    bm = cfg["BLOCK_SIZE_M"]
    if bm > gemm_rows_cap(m):
        return "BLOCK_SIZE_M > rows"
    row_tiles = -(-m // bm)
    gm = cfg["GROUP_SIZE_M"]
    if gm > 1 and (row_tiles == 1 or gm // 2 >= row_tiles):
        # one group holds every row tile: the same program order as a smaller group size
        return "GROUP_SIZE_M >= row tiles"
    return None


@dataclass
class Pruned:
    """Configs kept and a count of the dropped ones by reason."""

    kept: list[dict] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        parts = [f"{n} {why}" for why, n in self.dropped.most_common()]
        return f"{len(self.kept)} kept" + (f" (dropped: {', '.join(parts)})" if parts else "")


def prune(configs: Iterable[dict], *reasons) -> Pruned:
    """Keep configs for which every reason function returns None; dedupe."""
    out = Pruned()
    seen = set()
    for cfg in configs:
        why = next((r for fn in reasons if (r := fn(cfg)) is not None), None)
        if why is not None:
            out.dropped[why] += 1
            continue
        key = config_key(cfg)
        if key in seen:
            out.dropped["duplicate"] += 1
            continue
        seen.add(key)
        out.kept.append(cfg)
    return out


def moe_candidates(m: int, n: int, k: int, top_k: int, experts: int, dtype: str, block_shape,
                   limits: Limits, grid: Grid = COARSE, batch_prune: bool = True) -> Pruned:
    kinds = moe_kinds(n, k, dtype, block_shape)
    reasons = [lambda c: moe_static_reason(c, kinds, limits)]
    if batch_prune:
        reasons.append(lambda c: batch_reason_moe(c, m, top_k, experts))
    return prune(grid.configs(), *reasons)


def gemm_candidates(m: int, n: int, k: int, block_shape, limits: Limits, grid: Grid = COARSE,
                    batch_prune: bool = True) -> Pruned:
    kind = GemmKind(n=n, k=k, block_shape=block_shape)
    reasons = [lambda c: static_reason(c, kind, limits)]
    if batch_prune:
        reasons.append(lambda c: batch_reason_gemm(c, m))
    return prune(grid.configs(), *reasons)


def neighbours(cfg: dict, grid: Grid = FULL) -> list[dict]:
    """Configs one step from `cfg` in GROUP_SIZE_M, num_stages or num_warps (its other keys kept)."""
    out = []
    for key, values in (("GROUP_SIZE_M", grid.group_m), ("num_stages", grid.num_stages),
                        ("num_warps", grid.num_warps)):
        for v in values:
            if v != cfg.get(key):
                out.append({**cfg, key: v})
    return out


def down_variants(cfg: dict, grid: Grid = FULL) -> list[dict]:
    """Fused MoE: `cfg` with one down-GEMM key changed (as a `<KEY>_DOWN` override)."""
    base = down_part(cfg)
    out = []
    for key, values in (("BLOCK_SIZE_N", grid.block_n), ("BLOCK_SIZE_K", grid.block_k),
                        ("GROUP_SIZE_M", grid.group_m), ("num_warps", grid.num_warps),
                        ("num_stages", grid.num_stages)):
        for v in values:
            if v != base[key]:
                out.append(with_down(cfg, {key: v}))
    return out


def with_down(cfg: dict, down: dict) -> dict:
    """`cfg` with the down GEMM's keys set to `down` (only differences from the up GEMM are stored)."""
    up = up_part(cfg)
    merged = {**down_part(cfg), **down}
    out = dict(up)
    for key in DOWN_KEYS:
        if key in merged and merged[key] != up.get(key):
            out[f"{key}_DOWN"] = merged[key]
    return out


def config_key(cfg: dict) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in cfg.items()))


def describe(cfg: dict) -> str:
    """'M16 N32 K128 g1 w4 s4 | down N64' (or '... cuBLAS')."""
    up = up_part(cfg)
    text = (f"M{up['BLOCK_SIZE_M']} N{up['BLOCK_SIZE_N']} K{up['BLOCK_SIZE_K']} g{up.get('GROUP_SIZE_M', 1)} "
            f"w{up.get('num_warps', 4)} s{up.get('num_stages', 3)}")
    short = {"BLOCK_SIZE_N": "N", "BLOCK_SIZE_K": "K", "GROUP_SIZE_M": "g", "num_warps": "w", "num_stages": "s",
             "SPLIT_K": "split "}
    down = [f"{short.get(k[:-5], k[:-5])}{v}" for k, v in sorted(cfg.items()) if k.endswith("_DOWN")]
    if down:
        text += " | down " + " ".join(down)
    extra = [k for k in cfg if k not in KEYS and not k.endswith("_DOWN")]
    if cfg.get("CUBLAS"):
        text = "cuBLASLt (Triton fallback " + text + ")"
    extra = [k for k in extra if k != "CUBLAS"]
    if extra:
        text += " " + " ".join(f"{k}={cfg[k]}" for k in extra)
    return text
