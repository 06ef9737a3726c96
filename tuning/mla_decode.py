"""`dsctl tune-mla`: the MLA decode kernel's launch parameters per batch size for this GPU, and where FlashInfer is
installed whether its MLA decode is the faster one, written as the table kernels/tuned_configs.py looks up
(`MLA_DECODE,H=..,kv_dtype=..,device_name=...json`; the engine's `mla_decode` and the flashinfer-decode backend read it).

Per batch size: random queries and a random latent cache scattered over token slots (as the engine's pool holds
them) at each context length. Stage 1 times every tile candidate (`tile_candidates`) at the default split
settings; stage 2 the winner's split settings (`SPLIT_SETTINGS`). Each candidate is first checked against
`mla_decode_ref` once, on a small problem of its own (a candidate that fails the check or does not compile is
skipped), then timed as one CUDA-graph replay (median, L2 flushed); a candidate's score is the geometric mean over
the contexts. "fp8dot" rounds the queries to e4m3 as well: its bound is relative to what storing the cache in FP8
costs the same problem's output (`FP8DOT_ERR_RATIO`), so the tuner accepts the error an FP8 cache already
accepts, and no more. FlashInfer's
MLA decode (its fa3 kernel on Hopper) is timed on the same problems; FLASHINFER=1 marks a batch size where it
beat the best Triton config. The file is rewritten after every batch size, so a killed run keeps what it
finished (`resume` skips those).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from engine.checkpoint.config import ModelConfig
from engine.errors import UsageError
from kernels.mla_decode import DecodeConfig, config_to_ints, default_config, mla_decode, mla_decode_ref
from kernels.tuned_configs import MLA_KV_NAMES, load_configs, mla_decode_config_filename, save_configs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384)
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
SPLIT_SETTINGS = ((1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (3, 64), (4, 64))  # (programs / SM, min split)
ERR_BOUND = {"tile": 2e-2, "split": 2e-2}  # relative to the reference on the same cache (bf16 dots: about 4e-3)
# (every kv_load of kernels.mla_decode.KV_LOADS but fp8dot, whose bound follows)
# fp8dot against the reference on the same FP8 cache, as a multiple of the cache's own e4m3 error (the reference
# on the stored cache against the reference on the exact values). On random data at V3's softmax scale the
# queries' rounding costs 0.66-0.94x what the cache's rounding costs (CPU interpreter); 1.25 leaves room for the seed.
FP8DOT_ERR_RATIO = 1.25
CHECK_BATCH, CHECK_CONTEXT = 2, 1024  # the problem every candidate is checked on once


@dataclass(frozen=True)
class MlaShape:
    """One rank's MLA decode problem: query heads per request, the latent cache's widths and dtype."""

    heads: int  # per rank
    kv_lora_rank: int
    rope_dim: int
    kv_dtype: torch.dtype
    sm_scale: float
    q_per_req: int = 1  # query tokens per request (speculative verification: the draft tokens)

    @property
    def rows(self) -> int:
        return self.heads * self.q_per_req

    def filename(self, device_name: str) -> str:
        return mla_decode_config_filename(self.rows, MLA_KV_NAMES[self.kv_dtype], device_name)

    def title(self) -> str:
        return f"MLA decode, {self.heads} heads x {self.q_per_req} query token(s), {MLA_KV_NAMES[self.kv_dtype]} cache"


def mla_shape(cfg: ModelConfig, tp: int, dp: int, kv_cache_dtype: str, q_per_req: int = 1) -> MlaShape:
    """The decode problem of one rank: --tp ranks, of which --dp attention data-parallel groups (each group's
    attention splits the heads over tp / dp ranks)."""
    if cfg.kv_lora_rank is None:
        raise UsageError("tune-mla tunes MLA's latent-cache decode; this model has no kv_lora_rank")
    if tp < 1 or dp < 1 or tp % dp:
        raise UsageError(f"--dp {dp} must divide --tp {tp}")
    attn_tp = tp // dp
    if cfg.num_attention_heads % attn_tp:
        raise UsageError(f"{cfg.num_attention_heads} heads do not split over {attn_tp} attention ranks")
    if kv_cache_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
    return MlaShape(cfg.num_attention_heads // attn_tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                    KV_DTYPES[kv_cache_dtype], cfg.softmax_scale, q_per_req)


def tile_candidates(shape: MlaShape) -> list[DecodeConfig]:
    """Stage 1: head-block / token-tile / warps / stages / load-mode candidates (the default split settings)."""
    rows, fp8 = shape.rows, shape.kv_dtype.itemsize == 1
    small = rows <= 32  # 16 heads (TP 8), or 16 with a draft token: one head block per request
    block_h = (16 if rows <= 16 else 32) if small else 64  # 64+ rows: 64-row blocks, the wgmma tile
    tiles = [(block_h, bn, w, st) for bn in ((32, 64) if small else (16, 32, 64))
             for w in (4, 8) for st in ((2, 3) if small else (1, 2, 3))]
    if not fp8:
        loads = [("tile", False)]
    elif shape.kv_dtype == torch.float8_e4m3fn:
        # fp8dot with 16- or 32-row blocks runs mma.sync on operands Triton upcasts itself (KV_LOADS): only padded
        # to 64 rows below
        loads = [("split", True), ("split", False)] if small else [("split", True), ("fp8dot", True)]
    else:
        loads = [("split", True), ("split", False)]
    out = [DecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, kv_load=load, fp16_math=f16)
           for bh, bn, w, st in tiles for load, f16 in loads]
    if fp8 and small and shape.kv_dtype == torch.float8_e4m3fn:  # 16 heads padded to a 64-row FP8 wgmma block
        out += [DecodeConfig(block_h=64, block_n=bn, num_warps=8, num_stages=st, kv_load="fp8dot", fp16_math=True)
                for bn in (32, 64) for st in (2, 3)]
    default = default_config(rows, shape.kv_dtype)
    return [default] + [c for c in out if c != replace(default, min_split_tokens=c.min_split_tokens)]


def split_candidates(best: DecodeConfig) -> list[DecodeConfig]:
    """Stage 2: the stage-1 winner at every split setting."""
    return [replace(best, programs_per_sm=float(per_sm), min_split_tokens=min_split)
            for per_sm, min_split in SPLIT_SETTINGS]


class DecodeProblem:
    """Random queries and a scattered latent cache for `batch` requests of `ctx` cached tokens each."""

    def __init__(self, shape: MlaShape, batch: int, ctx: int, device: torch.device, seed: int = 0,
                 keep_exact: bool = False):
        g = torch.Generator(device=device).manual_seed(seed)
        width = shape.kv_lora_rank + shape.rope_dim
        slots = batch * ctx + 1
        values = torch.randn(slots, width, device=device, generator=g)
        self.exact = values if keep_exact else None  # float32 values before the cache's rounding (cache_error)
        self.scale = 1.0
        if shape.kv_dtype.itemsize == 1:
            self.scale = values.abs().amax().item() / 448.0
        self.cache = (values / self.scale).to(shape.kv_dtype)
        self.table = (torch.randperm(slots - 1, device=device, generator=g) + 1).view(batch, ctx).to(torch.int32)
        self.rows = torch.arange(batch, device=device)
        self.seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int64)
        n = batch * shape.q_per_req
        self.q = torch.randn(n, shape.heads, shape.kv_lora_rank, device=device, generator=g).to(torch.bfloat16)
        self.q_pe = torch.randn(n, shape.heads, shape.rope_dim, device=device, generator=g).to(torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.shape, self.batch, self.ctx = shape, batch, ctx

    def run(self, cfg: DecodeConfig) -> Callable[[], torch.Tensor]:
        s = self.shape
        return lambda: mla_decode(self.q, self.q_pe, self.cache, self.table, self.rows, self.seq_lens, s.sm_scale,
                                  q_per_req=s.q_per_req, kv_scale=self.scale, out=self.out, config=cfg)

    def error(self, cfg: DecodeConfig) -> float:
        """Relative error of `cfg`'s output against the torch reference on the same cache."""
        return _relative(self.run(cfg)(), self._reference(self.cache, self.scale))

    def cache_error(self) -> float:
        """What the cache's rounding costs the output: the reference on the stored cache against the reference on
        the exact values (needs keep_exact)."""
        if self.exact is None:
            raise ValueError("cache_error needs a DecodeProblem built with keep_exact=True")
        return _relative(self._reference(self.cache, self.scale), self._reference(self.exact, 1.0))

    def _reference(self, cache: torch.Tensor, scale: float) -> torch.Tensor:
        s = self.shape
        return mla_decode_ref(self.q, self.q_pe, cache, self.table, self.rows, self.seq_lens, s.sm_scale,
                              q_per_req=s.q_per_req, kv_scale=scale)

    def flashinfer(self, workspace: torch.Tensor) -> Callable[[], torch.Tensor]:
        """FlashInfer's MLA decode on the same problem (planned now, as the engine plans before a graph replay)."""
        s = self.shape
        return flashinfer_decode_fn(workspace, self.q, self.q_pe, self.cache, self.scale, self.table, s.sm_scale,
                                    self.out)


def flashinfer_decode_fn(workspace: torch.Tensor, q: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                         kv_scale: float, table: torch.Tensor, sm_scale: float, out: torch.Tensor,
                         backend: str = "auto") -> Callable[[], torch.Tensor]:
    """FlashInfer's MLA decode (`backend`: auto, fa2, fa3) of q / q_pe [B, H, kv_lora | rope] over the latent
    cache rows [slots, (1,) kv_lora + rope], every request reading all ctx slots of its row of table [B, ctx]:
    the wrapper planned now, the returned closure runs it (capturable in a CUDA graph)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # lazy: CUDA-only dependency

    b, ctx = table.shape
    i32 = dict(dtype=torch.int32)  # the lengths on the host, as the engine plans (the page indices on the GPU)
    meta = MLAPlanMetadata.csr(torch.arange(b + 1, **i32), torch.arange(b + 1, **i32) * ctx,
                               table.flatten().contiguous(), torch.full((b,), ctx, **i32))
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    cache = cache.reshape(cache.shape[0], 1, -1)
    wrapper.plan(metadata=meta, num_heads=q.shape[1], head_dim_ckv=q.shape[2], head_dim_kpe=q_pe.shape[2],
                 page_size=1, causal=False, sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=cache.dtype,
                 query_layout="split", kv_cache_layout="packed")
    scales = dict(ckv_scale=kv_scale, kpe_scale=kv_scale) if cache.dtype.itemsize == 1 else {}
    return lambda: wrapper.run(query=(q, q_pe), kv_cache=cache, out=out, **scales)


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median microseconds of one CUDA-graph replay of fn (L2 flushed before each); on CPU (the Triton
    interpreter: tests only) one timed call."""
    fn()  # compile / plan outside the capture
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from triton.testing import do_bench  # lazy: CUDA-only timing

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=5, rep=reps, return_mode="median") * 1e3


@dataclass
class BatchResult:
    """What tuning one batch size found (µs: geometric mean over the contexts)."""

    batch: int
    config: DecodeConfig
    tuned_us: float
    default_us: float
    flashinfer_us: Optional[float] = None
    tried: int = 0
    rejected: list[str] = field(default_factory=list)

    @property
    def flashinfer_faster(self) -> bool:
        return self.flashinfer_us is not None and self.flashinfer_us < self.tuned_us

    def entry(self) -> dict:
        out = config_to_ints(self.config)
        if self.flashinfer_us is not None:
            out["FLASHINFER"] = int(self.flashinfer_faster)
        return out


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass
class MlaTuner:
    """Tunes one MlaShape on `device`; `timer` times a closure in µs (graph_time_us; tests pass their own)."""

    shape: MlaShape
    device: torch.device
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    timer: Callable[[Callable[[], object]], float] = graph_time_us
    flashinfer: bool = False  # also time FlashInfer's MLA decode
    log: Callable[[str], None] = print
    checked: dict = field(default_factory=dict)  # config -> its error against the reference (checked once)
    check: Optional[DecodeProblem] = None  # the small problem every candidate is checked on (built on first use)
    check_cache_error: float = math.nan  # what the check problem's cache rounding costs (8-bit caches)

    def bound(self, cfg: DecodeConfig) -> float:
        """The largest relative error a candidate may have on the check problem."""
        if cfg.kv_load == "fp8dot" and self.shape.kv_dtype.itemsize == 1:
            self._check_problem()
            return FP8DOT_ERR_RATIO * self.check_cache_error
        return ERR_BOUND["tile" if cfg.kv_load == "fp8dot" else cfg.kv_load]  # fp8dot on a 16-bit cache runs "tile"

    def _check_problem(self) -> DecodeProblem:
        if self.check is None:
            ctx = min(CHECK_CONTEXT, max(self.contexts))
            self.check = DecodeProblem(self.shape, CHECK_BATCH, ctx, self.device, seed=1, keep_exact=True)
            if self.shape.kv_dtype.itemsize == 1:
                self.check_cache_error = self.check.cache_error()
        return self.check

    def tune_batch(self, batch: int) -> BatchResult:
        problems = [DecodeProblem(self.shape, batch, ctx, self.device, seed=batch + ctx) for ctx in self.contexts]
        rejected: list[str] = []
        scored = self._score(tile_candidates(self.shape), problems, rejected)
        default = default_config(self.shape.rows, self.shape.kv_dtype)
        if not scored:
            raise RuntimeError(f"batch {batch}: no candidate ran ({'; '.join(rejected[:3])})")
        best = min(scored, key=scored.get)
        scored.update(self._score(split_candidates(best), problems, rejected))
        best = min(scored, key=scored.get)
        default_us = scored.get(default) or self._score([default], problems, rejected).get(default, math.inf)
        result = BatchResult(batch, best, scored[best], default_us, tried=len(scored), rejected=rejected)
        if self.flashinfer:
            result.flashinfer_us = self._flashinfer_us(problems)
        return result

    def _score(self, configs: list[DecodeConfig], problems: list[DecodeProblem], rejected: list[str]) -> dict:
        out = {}
        for cfg in configs:
            try:
                if cfg not in self.checked:  # a config's output does not depend on the batch size: check it once
                    self.checked[cfg] = self._check_problem().error(cfg)
                err = self.checked[cfg]
                if not err <= self.bound(cfg):
                    rejected.append(f"{cfg}: error {err:.2e} > {self.bound(cfg):.2e}")
                    continue
                out[cfg] = _geomean([self.timer(p.run(cfg)) for p in problems])
            except Exception as exc:  # noqa: BLE001 - a config this GPU cannot run (shared memory, registers)
                rejected.append(f"{cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
        return out

    def _flashinfer_us(self, problems: list[DecodeProblem]) -> Optional[float]:
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=self.device)
        try:
            return _geomean([self.timer(p.flashinfer(workspace)) for p in problems])
        except Exception as exc:  # noqa: BLE001 - FlashInfer refuses this shape / dtype: the Triton kernel decodes
            self.log(f"FlashInfer's MLA decode did not run: {type(exc).__name__}: {str(exc)[:160]}")
            return None


def tune_mla(tuner: MlaTuner, batch_sizes: list[int], out_path: Path, resume: bool = False) -> list[BatchResult]:
    """Tune every batch size, rewriting `out_path` after each (a killed run keeps what it finished; `resume`
    skips the batch sizes the file holds)."""
    table = load_configs(out_path) if resume and out_path.is_file() else {}
    results = []
    for batch in batch_sizes:
        if batch in table:
            tuner.log(f"batch {batch}: in {out_path.name} already (--resume)")
            continue
        t = time.perf_counter()
        result = tuner.tune_batch(batch)
        table[batch] = result.entry()
        save_configs(out_path, table)
        results.append(result)
        fi = f", FlashInfer {result.flashinfer_us:.1f} us" if result.flashinfer_us is not None else ""
        skipped = f"; {len(result.rejected)} skipped, e.g. {result.rejected[0]}" if result.rejected else ""
        tuner.log(f"batch {batch}: {result.tuned_us:.1f} us (default {result.default_us:.1f} us{fi}), "
                  f"{result.tried} configs in {time.perf_counter() - t:.0f} s{skipped}")
    return results
