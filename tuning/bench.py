"""Time launch configs on random problems of the real shape; successive halving; numerical check.

Problems: random (never zero) weights of the real shape (FP8 with random block scales, bf16, or packed
INT4 with random group scales for w4afp8);
fused-MoE routing drawn by the model's own router (kernels/moe_gate reference: noaux_tc,
grouped or greedy top-k) on random logits plus a fixed per-expert popularity offset, so some
experts are hot as in real traffic; with EP, this rank keeps the ids of its own experts and the
others become -1 (the kernel skips them).

Timing (GPU): a CUDA graph holding R calls, each on a different input set (R routings for fused
MoE, R weight copies for the GEMM, so weights are not served from L2), replayed `reps` times
between CUDA events; a sample is replay time / R in microseconds. The engine replays decode
batches as graphs, so launch gaps are the graph's, not Python's. On CPU (Triton interpreter)
the same calls are timed with a wall clock (only to exercise the code).

Successive halving: every candidate gets a few timed replays, the fastest 1/eta go on to more
replays, and so on; the last round ranks the survivors on all their samples (median).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kernels.fp8_math import block_scale_shape
from kernels.int4 import INT4_GROUP
from tuning.search_space import config_key
from tuning.shapes import GemmShape, MoEShape

FP8 = torch.float8_e4m3fn
ROTATION_BYTES = 256 << 20  # GEMM weight copies per graph: enough bytes to defeat a 50 MB L2


# --------------------------------------------------------------------------- problems


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _random_fp8(shape, block, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weight (values ~N(0, 1)) and float32 block scales in [0.005, 0.015)."""
    w = torch.empty(shape, dtype=FP8, device=device)
    for i in range(shape[0]):  # one leading slice at a time: bounded temporary memory
        w[i] = torch.randn(shape[1:], generator=gen, device=device, dtype=torch.float32).to(FP8)
    scale = torch.rand(block_scale_shape(shape, block), generator=gen, device=device) * 0.01 + 0.005
    return w, scale


def _random_int4(shape, group, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed INT4 weight (every byte value, so both nibbles span [-8, 7]) and float32 group scales
    in [0.001, 0.003) (kernels/int4.py's layout)."""
    w = torch.randint(-128, 128, (*shape[:-1], shape[-1] // 2), generator=gen, device=device, dtype=torch.int8)
    scale = torch.rand((*shape[:-1], shape[-1] // group), generator=gen, device=device) * 0.002 + 0.001
    return w, scale


class MoEProblem:
    """Expert weights of one rank plus per-batch-size inputs (tokens, routing)."""

    kind = "moe"

    def __init__(self, shape: MoEShape, device, seed: int = 0, skew: float = 0.5):
        self.shape, self.device, self.seed = shape, torch.device(device), seed
        s = shape
        gen = _generator(self.device, seed)
        if s.dtype == "fp8_w8a8":
            self.w13, self.w13_scale = _random_fp8((s.E, 2 * s.N, s.K), s.block_shape, gen, self.device)
            self.w2, self.w2_scale = _random_fp8((s.E, s.K, s.N), s.block_shape, gen, self.device)
        elif s.dtype == "w4afp8":
            self.w13, self.w13_scale = _random_int4((s.E, 2 * s.N, s.K), INT4_GROUP, gen, self.device)
            self.w2, self.w2_scale = _random_int4((s.E, s.K, s.N), min(INT4_GROUP, s.N), gen, self.device)
        else:
            self.w13 = (torch.randn(s.E, 2 * s.N, s.K, generator=gen, device=self.device) * 0.02).to(torch.bfloat16)
            self.w2 = (torch.randn(s.E, s.K, s.N, generator=gen, device=self.device) * 0.02).to(torch.bfloat16)
            self.w13_scale = self.w2_scale = None
        n_all = s.routing.n_experts
        self.popularity = torch.randn(n_all, generator=gen, device=self.device) * skew
        self.bias = torch.randn(n_all, generator=gen, device=self.device) * 0.05

    def rotations(self, m: int) -> int:
        if self.device.type != "cuda":
            return 1
        return max(1, min(8, math.ceil(256 / m)))  # enough routings that the experts touched exceed L2

    def routing(self, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        from kernels.moe_gate import moe_gate_ref  # lazy: imports triton; keeps --dry-run (CPU) off it

        r = self.shape.routing
        logits = torch.randn(m, r.n_experts, generator=gen, device=self.device) + self.popularity
        weights, ids = moe_gate_ref(logits, top_k=r.top_k, method=r.method, n_group=r.n_group,
                                    topk_group=r.topk_group,
                                    correction_bias=self.bias if r.method == "noaux_tc" else None,
                                    norm_topk_prob=r.norm_topk_prob, routed_scaling_factor=r.routed_scaling_factor,
                                    scoring_func=r.scoring_func)
        if self.shape.ep > 1:  # this rank owns experts [0, E): the others' ids are skipped
            ids = torch.where(ids < self.shape.E, ids, torch.full_like(ids, -1))
        return ids.contiguous(), weights.contiguous()

    def inputs(self, m: int, count: int) -> list[tuple]:
        gen = _generator(self.device, self.seed * 1000 + m)
        out = []
        for _ in range(count):
            x = torch.randn(m, self.shape.K, generator=gen, device=self.device).to(torch.bfloat16)
            ids, weights = self.routing(m, gen)
            out.append((x, ids, weights))
        return out

    def run(self, cfg: dict, inp: tuple, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        from kernels.fused_moe import fused_moe  # lazy: imports triton; keeps --dry-run (CPU) off it
        from kernels.fused_moe_w4a8 import fused_moe_w4a8  # lazy: imports triton; keeps --dry-run (CPU) off it

        x, ids, weights = inp
        if self.shape.dtype == "w4afp8":
            return fused_moe_w4a8(x, self.w13, self.w2, ids, weights, w13_scale=self.w13_scale,
                                  w2_scale=self.w2_scale, config=cfg, out=out)
        return fused_moe(x, self.w13, self.w2, ids, weights, w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                         block_shape=self.shape.block_shape or (128, 128), config=cfg, out=out)

    def reference(self, inp: tuple) -> torch.Tensor:
        from kernels.fused_moe import fused_moe_ref  # lazy: imports triton; keeps --dry-run (CPU) off it
        from kernels.fused_moe_w4a8 import fused_moe_w4a8_ref  # lazy: imports triton; keeps --dry-run off it

        x, ids, weights = inp
        if self.shape.dtype == "w4afp8":
            return fused_moe_w4a8_ref(x, self.w13, self.w2, ids, weights, w13_scale=self.w13_scale,
                                      w2_scale=self.w2_scale)
        return fused_moe_ref(x, self.w13, self.w2, ids, weights, w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                             block_shape=self.shape.block_shape or (128, 128))

    def tolerance(self) -> float:
        # vs the torch mirror of the same roundings: e4m3 re-roundings of the intermediate (wgmma
        # accumulation order) give up to ~1% (docs/perf.md); a broken config gives ~100%
        return 3e-2 if self.shape.dtype in ("fp8_w8a8", "w4afp8") else 2e-2


class GemmProblem:
    """R copies of one FP8 weight [N, K] (+ block scales) and R activations per batch size."""

    kind = "gemm"

    def __init__(self, shape: GemmShape, device, seed: int = 0, copies: Optional[int] = None):
        self.shape, self.device, self.seed = shape, torch.device(device), seed
        gen = _generator(self.device, seed)
        if copies is None:
            copies = 1
            if self.device.type == "cuda":
                copies = max(1, min(16, math.ceil(ROTATION_BYTES / (shape.N * shape.K))))
        w, s = _random_fp8((copies, shape.N, shape.K), shape.block_shape, gen, self.device)
        self.weights = [(w[i], s[i]) for i in range(copies)]

    def rotations(self, m: int) -> int:
        return len(self.weights)

    def inputs(self, m: int, count: int) -> list[tuple]:
        gen = _generator(self.device, self.seed * 1000 + m)
        return [(torch.randn(m, self.shape.K, generator=gen, device=self.device).to(torch.bfloat16),
                 *self.weights[i % len(self.weights)]) for i in range(count)]

    def run(self, cfg: dict, inp: tuple, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        from kernels.fp8 import block_fp8_matmul  # lazy: imports triton; keeps --dry-run (CPU) off it

        a, w, s = inp
        return block_fp8_matmul(a, w, s, self.shape.block_shape, config=cfg, out=out)

    def reference(self, inp: tuple) -> torch.Tensor:
        from kernels.fp8 import block_fp8_matmul_ref  # lazy: imports triton; keeps --dry-run (CPU) off it

        a, w, s = inp
        return block_fp8_matmul_ref(a, w, s, self.shape.block_shape)

    def tolerance(self) -> float:
        return 2e-2


# --------------------------------------------------------------------------- timing


class Timer:
    """us per call of `launch` (which makes `calls` kernel-op calls): CUDA graph + events, or wall clock."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def measure(self, launch: Callable[[], None], calls: int, reps: int) -> list[float]:
        if not self.cuda:  # Triton interpreter: nothing to compile or warm up; wall clock (only exercises the code)
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                launch()
                out.append((time.perf_counter() - t0) * 1e6 / calls)
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up: compiles, first-use probes, allocator
            launch()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                launch()
            graph.replay()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(reps)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            return [start.elapsed_time(end) * 1e3 / calls for start, end in events]
        finally:
            del graph
            torch.cuda.empty_cache()  # give the graph's private memory pool back


@dataclass
class Trial:
    cfg: dict
    samples: list = field(default_factory=list)
    error: Optional[str] = None

    @property
    def us(self) -> float:
        return statistics.median(self.samples) if self.samples and self.error is None else math.inf


class Bench:
    """Measures configs of one problem at one batch size (inputs built once, R per graph)."""

    def __init__(self, problem, m: int, timer: Timer):
        self.problem, self.m, self.timer = problem, m, timer
        self.calls = problem.rotations(m)
        self.inputs = problem.inputs(m, self.calls)
        self.trials: dict[tuple, Trial] = {}

    def trial(self, cfg: dict) -> Trial:
        key = config_key(cfg)
        if key not in self.trials:
            self.trials[key] = Trial(dict(cfg))
        return self.trials[key]

    def measure(self, cfg: dict, reps: int) -> Trial:
        t = self.trial(cfg)
        if t.error is not None:
            return t
        inputs, run = self.inputs, self.problem.run

        def launch():
            for inp in inputs:
                run(cfg, inp)

        try:
            t.samples.extend(self.timer.measure(launch, self.calls, reps))
        except Exception as exc:  # noqa: BLE001 - a config that cannot launch (resources, compile) is dropped
            t.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if self.timer.cuda:
                torch.cuda.synchronize()
        return t

    def check(self, cfg: dict) -> float:
        """Relative error of cfg's output against the torch reference (inf if not finite).

        The output buffer starts as NaN, so rows the kernel fails to write show up."""
        inp = self.inputs[0]
        ref = self.problem.reference(inp).float()
        out = torch.full(ref.shape, float("nan"), dtype=inp[0].dtype, device=ref.device)
        got = self.problem.run(cfg, inp, out=out).float()
        if not torch.isfinite(got).all():
            return math.inf
        return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def successive_halving(bench: Bench, configs: list[dict], rounds=(2, 6, 20), eta: int = 3, keep: int = 3,
                       on_result: Optional[Callable[[Trial], None]] = None) -> list[Trial]:
    """Rank configs: all get rounds[0] replays, the best 1/eta (at least `keep`) rounds[1] more, ...

    Returns the trials of the last round, fastest first (failed configs last)."""
    alive = [bench.trial(c) for c in configs]
    for i, reps in enumerate(rounds):
        for t in alive:
            bench.measure(t.cfg, reps)
            if on_result:
                on_result(t)
        alive.sort(key=lambda t: t.us)
        if i + 1 < len(rounds):
            n = max(keep, math.ceil(len(alive) / eta))
            alive = [t for t in alive[:n] if t.error is None]
    return alive


def final_ranking(bench: Bench, configs: list[dict], reps: int, passes: int = 3,
                  on_result: Optional[Callable[[Trial], None]] = None) -> list[Trial]:
    """Time the finalists in interleaved passes (drift hits all alike); fastest first."""
    trials = [bench.trial(c) for c in configs]
    fresh = {id(t): [] for t in trials}
    per = max(1, reps // passes)
    for _ in range(passes):
        for t in trials:
            before = len(t.samples)
            bench.measure(t.cfg, per)
            fresh[id(t)].extend(t.samples[before:])
            if on_result:
                on_result(t)
    # rank on this round's samples only: every finalist measured under the same conditions
    for t in trials:
        if t.error is None and fresh[id(t)]:
            t.samples = fresh[id(t)]
    return sorted(trials, key=lambda t: t.us)
