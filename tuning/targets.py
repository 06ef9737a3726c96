"""What is tuned: a fused-MoE shape or a block-FP8 GEMM shape, behind one small interface.

A target knows its config file name, its built-in default config, its candidate configs at a
batch size (stage 1, the coarse grid; or the full grid for --exhaustive), the local refinements
around the best ones, and how to build a random problem of its shape for bench.py.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from kernels.int4 import INT4_GROUP
from kernels.tuned_configs import default_fp8_gemm_config, default_moe_config
from kernels.w4a8_gemm import swapped
from tuning import search_space as ss
from tuning.bench import GemmProblem, MoEProblem
from tuning.shapes import GemmShape, MoEShape

SPLIT_K_CHOICES = (1, 2, 4, 8)  # explicit K splits timed for the best tiles (1: none, whatever the GPU)


def w4afp8_sums_variants(cfg: dict, n: int) -> list[dict]:
    """`cfg` with ACT_SUMS off (the kernel sums its loaded tiles; kernels/w4a8_gemm.py `act_sums`, on by default)
    for its swapped gate_up GEMM, its swapped down GEMM, and both; n: the experts' intermediate size (the down
    GEMM's K, its INT4 group min(128, n))."""
    up = swapped(ss.up_part(cfg), INT4_GROUP)
    down = swapped(ss.down_part(cfg), min(INT4_GROUP, n))
    keys = [k for k, on in (("ACT_SUMS", up), ("ACT_SUMS_DOWN", down)) if on]
    sets = [[k] for k in keys] + ([keys] if len(keys) == 2 else [])
    return [{**cfg, **{k: 0 for k in ks}} for ks in sets]


class MoETarget:
    kind = "moe"
    command = "tune-moe"

    def __init__(self, shape: MoEShape):
        self.shape = shape
        self.kinds = ss.moe_kinds(shape.N, shape.K, shape.dtype, shape.block_shape)

    def filename(self, device: str) -> str:
        return self.shape.filename(device)

    def title(self) -> str:
        return f"fused MoE {self.shape.describe()}"

    def meta(self) -> dict:
        return {"kind": self.kind, "shape": asdict(self.shape)}

    def problem(self, device, seed: int = 0):
        return MoEProblem(self.shape, device, seed)

    def default_config(self, m: int) -> dict:
        s = self.shape
        return default_moe_config(m, s.E, s.N, s.top_k, s.dtype)

    def _batch(self, m: int):
        return lambda c: ss.batch_reason_moe(c, m, self.shape.top_k, self.shape.E)

    def _static(self, limits: ss.Limits):
        return lambda c: ss.moe_static_reason(c, self.kinds, limits)

    def candidates(self, m: int, limits: ss.Limits, grid: ss.Grid, batch_prune: bool = True) -> ss.Pruned:
        s = self.shape
        return ss.moe_candidates(m, s.N, s.K, s.top_k, s.E, s.dtype, s.block_shape, limits, grid, batch_prune)

    def refine(self, cfgs: list[dict], m: int, limits: ss.Limits, grid: ss.Grid = ss.FULL) -> list[dict]:
        around = [n for c in cfgs for n in ss.neighbours(c, grid)]
        return ss.prune(around, self._static(limits), self._batch(m)).kept

    def down(self, cfg: dict, limits: ss.Limits, grid: ss.Grid = ss.FULL) -> list[dict]:
        return ss.prune(ss.down_variants(cfg, grid), self._static(limits)).kept

    def extras(self, cfg: dict, device) -> list[dict]:
        """The best config with the gate_up GEMM's K loop in SPLIT_K_CHOICES parts (the down GEMM unsplit: its
        K is the small N). The W4AFP8 kernel has no split: its best config with the swapped GEMMs summing the
        activations' groups themselves instead of reading the quantiser's sums (ACT_SUMS 0, each GEMM alone and
        both; none where neither GEMM of the config is swapped)."""
        if self.shape.dtype == "w4afp8":
            return w4afp8_sums_variants(cfg, self.shape.N)
        return [{**cfg, "SPLIT_K": s, "SPLIT_K_DOWN": 1} for s in SPLIT_K_CHOICES]

    def finalize(self, winner: dict, ranked: list[dict]) -> dict:
        return winner


class GemmTarget:
    kind = "gemm"
    command = "tune-fp8"

    def __init__(self, shape: GemmShape):
        self.shape = shape
        self.gemm = ss.GemmKind(n=shape.N, k=shape.K, block_shape=shape.block_shape)

    def filename(self, device: str) -> str:
        return self.shape.filename(device)

    def title(self) -> str:
        return f"block-FP8 GEMM {self.shape.describe()}"

    def meta(self) -> dict:
        return {"kind": self.kind, "shape": asdict(self.shape)}

    def problem(self, device, seed: int = 0):
        return GemmProblem(self.shape, device, seed)

    def default_config(self, m: int) -> dict:
        return default_fp8_gemm_config(m, self.shape.N, self.shape.K)

    def candidates(self, m: int, limits: ss.Limits, grid: ss.Grid, batch_prune: bool = True) -> ss.Pruned:
        s = self.shape
        return ss.gemm_candidates(m, s.N, s.K, s.block_shape, limits, grid, batch_prune)

    def refine(self, cfgs: list[dict], m: int, limits: ss.Limits, grid: ss.Grid = ss.FULL) -> list[dict]:
        around = [n for c in cfgs for n in ss.neighbours(c, grid)]
        return ss.prune(around, lambda c: ss.static_reason(c, self.gemm, limits),
                        lambda c: ss.batch_reason_gemm(c, m)).kept

    def down(self, cfg: dict, limits: ss.Limits, grid: ss.Grid = ss.FULL) -> list[dict]:
        return []

    def extras(self, cfg: dict, device) -> list[dict]:
        """The best tiles with the K loop split in SPLIT_K_CHOICES parts (the search itself runs the kernel's
        automatic split), and cuBLASLt's block-scaled GEMM where this torch / GPU / shape has it (CUBLAS: 1)."""
        from kernels.fp8 import cublas_block_fp8_supported  # lazy: imports triton; keeps --dry-run (CPU) off it

        tiles = triton_part(cfg)
        k_blocks = -(-self.shape.K // tiles["BLOCK_SIZE_K"])
        out = [{**tiles, "SPLIT_K": s} for s in SPLIT_K_CHOICES if s <= k_blocks]
        if cublas_block_fp8_supported(device, self.shape.block_shape, self.shape.K, self.shape.N):
            out.append({**tiles, "CUBLAS": 1})
        return out

    def finalize(self, winner: dict, ranked: list[dict]) -> dict:
        """A cuBLAS winner keeps the fastest Triton tiles as its fallback (used where cuBLAS is not)."""
        if not winner.get("CUBLAS"):
            return winner
        best_triton: Optional[dict] = next((c for c in ranked if not c.get("CUBLAS")), None)
        return {**{k: v for k, v in (best_triton or winner).items() if k != "CUBLAS"}, "CUBLAS": 1}


def triton_part(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("CUBLAS", "SPLIT_K")}
