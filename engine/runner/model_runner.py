"""ModelRunner: builds the model on its device, loads weights, owns the KV memory and runs forwards.

It picks the device and dtype, decides whether FP8 weights stay FP8 (CUDA W8A8) or are dequantised,
resolves every op's kernel by name (engine/model/kernel_registry.py: 'auto',
start-up checks, factories) and builds the model with them, sizes the KV pool and request
table, and builds the `ForwardContext` every forward passes down the layers. It registers the tuned
kernel-config directory (--kernel-config-dir, default $DSCTL_KERNEL_CONFIG_DIR) with
kernels/tuned_configs.py.

Forwards run through `run_forward`: a captured CUDA graph when one holds the batch, else eagerly;
under DP attention each is first agreed with the other groups (engine/distributed/dp_sync.py, which
runs this runner's idle forwards). The speculative draft's forwards (engine/speculative/) run on this
runner's KV pool and context: the runner takes a `draft` factory and captures the draft's graphs
after its own.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Optional, Protocol

import torch

from engine.args import EngineArgs
from engine.checkpoint.resolve import ResolvedModel, resolve_model
from engine.distributed.comm import all_reduce_min_int, broadcast_tensor
from engine.distributed.dp_attention import TARGET, DPGather
from engine.distributed.dp_sync import DPSync, IdleForward
from engine.distributed.expert_placement import ExpertPlacement, placement_for
from engine.distributed.groups import ParallelState, single_process
from engine.errors import UsageError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.plan import PlanSpec, kv_pool_tokens, plan_memory, spec_from_args, used_by_others
from engine.memory.plan_check import OTHERS_NOTED, judge
from engine.memory.pools import KVPool, ReqToTokenPool, kv_row_dim
from engine.model.builder import build_model
from engine.model.context import ForwardContext
from engine.model.expert_load import ExpertLoad, ExpertLoadReport
from engine.model.kernel_registry import (
    ATTENTION,
    MOE,
    PREFILL_ATTENTION,
    KernelChoice,
    KernelSetup,
    build_kernels,
    describe,
    resolve_kernels,
)
from engine.model.moe import MoE
from engine.model.rope import RotaryEmbedding
from engine.model.two_batch import TwoBatchOverlap, split_point
from engine.runner.capture_memory import told_out_of_memory
from engine.runner.cuda_graph import CudaGraphRunner
from engine.runner.device import pick_device, pick_dtype
from engine.runner.piecewise_graph import PiecewiseGraphs, bucket_sizes
from engine.runner.triton_precompile import (
    LateCompileLog,
    compile_in_background,
    compiled_kernel,
    default_workers,
    record,
)
from engine.weights.loader import has_mtp_layer, iter_params
from engine.weights.w4afp8 import with_int4_experts
from kernels import pdl, tuned_configs
from kernels.fp8_math import WEIGHT_BLOCK
from kernels.interpret import interpreting

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DEFAULT_CPU_KV_TOKENS = 32768


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows = fb.logits_indices
    hidden: torch.Tensor  # [T, hidden] pre-norm hidden states of every token (MTP input)


EagerForward = Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor]]  # fb -> (logits, hidden)


class Draft(Protocol):
    """A speculative draft (engine/speculative/draft_runner.py `DraftRunner`), made by the `draft` factory
    the runner is given, after the model and before the KV pool (which holds a cache layer for it). Its
    CUDA graphs are captured right after the model's and released with them."""

    layer: torch.nn.Module  # the MTP layer it runs

    def build_graphs(self, batch_sizes: list[int], capture: bool) -> None: ...

    def release(self) -> None: ...


@contextmanager
def timed(into: dict[str, float], name: str):
    """Seconds spent inside the block, as into[name] (a start-up phase, for the logs)."""
    start = time.perf_counter()
    yield
    into[name] = time.perf_counter() - start


def _raise_recompile_limits() -> None:
    """torch.compile specialises each layer's code per layer index and batch size, and every engine built in
    a process adds its own modules: past dynamo's default recompile limit (8 per code object) it falls
    back to eager mid-graph, which breaks CUDA-graph capture. Allow one compile per layer and size."""
    import torch._dynamo.config as dynamo_config  # lazy: dynamo loads only for torch.compile, a CUDA path

    for name, floor in (("recompile_limit", 1024), ("accumulated_recompile_limit", 8192)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), floor))


def prefill_token_counts(cap: int) -> list[int]:
    """Prefill token counts (at most `cap`) that cover the tuned configs' batch-size keys and Triton's
    integer specialisations (multiple of 16 or not, and 1: a prompt sharing only its first token with a cached
    one expands a 1-token prefix) of the kernels a prefill step launches."""
    keys = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]  # above 4096: 4096's
    return sorted({m for k in keys for m in (k, k + 1) if m <= cap} | {min(cap, 4097)})






class ModelRunner:
    def __init__(self, args: EngineArgs, resolved: Optional[ResolvedModel] = None,
                 parallel: Optional[ParallelState] = None, draft: Optional[Callable[[ModelRunner], Draft]] = None):
        """`parallel`: this rank's place in the TP world (default: one process, nothing split); `draft`: makes
        the speculative draft (engine/speculative/draft_runner.py) once the model is built (None: no draft)."""
        args.validate()
        self.args = args
        tuned_configs.set_user_config_dir(args.kernels.config_dir())
        self.resolved = resolved or resolve_model(args.model)
        self.resolved = replace(self.resolved, config=with_int4_experts(self.resolved.config, args.model.quantization))
        cfg = self.resolved.config
        self.device = pick_device(args.model.device) if parallel is None else parallel.device
        self.parallel = parallel or single_process(self.device)
        self.dp = self._dp_sync()
        self.dtype = pick_dtype(args.model.dtype, self.device)
        self.num_layers = args.model.num_layers or cfg.num_hidden_layers
        self.max_running_requests = args.scheduler.max_running_requests
        self.config = cfg.with_num_layers(self.num_layers)
        self.fp8_block = self._fp8_block()
        self.max_model_len = min(args.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.setup = KernelSetup(self.config, self.device, self.dtype, self._kv_dtype(),
                                 tuple(self._graph_batch_sizes()), interpreting(),
                                 tp_size=self.parallel.tp.attention.size, expanded_kv=args.kernels.disable_mla,
                                 fp8_block=self.fp8_block, group=self.parallel.tp,
                                 micro_batches=args.parallel.enable_two_batch_overlap)
        self.kernel_choice = self._pick_backends()
        self.kernels = build_kernels(self.kernel_choice, self.setup)
        self.others_bytes = self._memory_held_elsewhere()
        phases = {}
        with timed(phases, "weights"):
            self._build_model(draft)
        with timed(phases, "KV pool"):
            self._init_memory()
        self.graphs = self.prefill_compiles = None
        workers = self._triton_compile_workers() if self.device.type == "cuda" else 0
        early = compiled_kernel() if workers else None
        if early is not None:
            log.info("Triton kernel %s already compiled in this process: no parallel precompile", early)
            workers = 0
        # the recording forwards hold collectives: every rank runs them or none does
        self.compile_workers = workers = all_reduce_min_int(workers, self.parallel.tp)
        prefill_kernels = []
        if workers:
            with timed(phases, "prefill kernels"):
                prefill_kernels = self._record_prefill()  # before the capture compiles anything in-process
        sizes = self._piecewise_sizes()
        if self.setup.cuda_graphs:  # the padding marks' buffer at its largest, before anything is captured
            rows = max(max(self.setup.graph_batch_sizes), max(sizes, default=0))
            self.forward_ctx.reserve_padding(self.parallel.tp.dp_size * rows, self.device)
            graph_sizes = list(self.setup.graph_batch_sizes)
            with timed(phases, "CUDA graphs"), self._capture_room(
                    f"the decode CUDA graphs of up to {max(graph_sizes)} requests",
                    f"--cuda-graph-max-bs {max(1, max(graph_sizes) // 2)}"):
                self.build_graph_runner(graph_sizes)
        if prefill_kernels:
            self.prefill_compiles = compile_in_background(prefill_kernels, workers)
            if not args.kernels.skip_compile_wait:
                with timed(phases, "prefill kernels compile"):
                    self.prefill_compiles.wait()  # so that no request waits for one (issue: smooth streaming)
        self.piecewise = None
        if sizes:
            with timed(phases, "piecewise graphs"), self._capture_room(
                    f"the piecewise CUDA graphs of extend steps up to {max(sizes)} tokens"
                    + (f" per DP group ({self.parallel.tp.dp_size} groups)" if self.dp_attention else ""),
                    f"--piecewise-cuda-graph-max-tokens {max(sizes) // 2}, or 0 for none"):
                self.build_piecewise(sizes)
        self.two_batch_forwards = 0  # this rank's own forwards run as two micro-batches (--enable-two-batch-overlap)
        self.forward_paths: dict[str, int] = {}  # the model's own forwards per path (`count_forward`)
        self.late_compiles = LateCompileLog()
        if self.device.type == "cuda":
            self.late_compiles.install()  # from here on a compile stalls a step: say which and how long
        self._report(phases)

    def _capture_room(self, what: str, smaller: str) -> ContextManager:
        """A capture whose running out of GPU memory stops start-up with the flags that leave more room."""
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        return told_out_of_memory(what, total, self.args.cache.mem_fraction_static, smaller)

    def _report(self, phases: dict[str, float]) -> None:
        """One start-up line per rank: its weight and KV bytes, KV tokens, and how long each phase took."""
        modules = {"": self.model, **({"mtp.": self.mtp} if self.mtp is not None else {})}
        unique = {p.data_ptr(): p for _, p in iter_params(modules)}  # the MTP layer may share embed / head
        weights = sum(p.numel() * p.element_size() for p in unique.values())
        kv = self.kv_pool.nbytes()
        log.info("rank %d: weights %.2f GB, KV pool %d tokens (%.2f GB); start-up %s", self.parallel.world_rank,
                 weights / 1e9, self.kv_pool.size, kv / 1e9,
                 ", ".join(f"{name} {secs:.1f} s" for name, secs in phases.items()))

    def _pick_backends(self) -> KernelChoice:
        """Each op's kernel (engine/model/kernel_registry.py: 'auto' resolved) after its start-up check, which
        rejects what cannot run here; logged once per rank."""
        choice = resolve_kernels(self.args.kernels.requested_kernels(), self.setup)
        pdl.set_enabled(self._use_pdl())
        log.info("rank %d kernels: %s, pdl %s", self.parallel.world_rank, describe(choice, self.setup),
                 "on" if pdl.enabled() else "off")
        return choice

    def _use_pdl(self) -> bool:
        """--pdl: 'auto' is on where programmatic dependent launch can run (kernels/pdl.py), 'on' refuses to
        start elsewhere."""
        asked = self.args.kernels.pdl
        if asked == "off":
            return False
        why = "the Triton interpreter runs the kernels" if self.setup.interpret else pdl.supported(self.device)
        if why and asked == "on":
            raise UsageError(f"--pdl on: {why}; use --pdl auto (on where it can run) or off")
        return not why

    def _kv_dtype(self) -> torch.dtype:
        """The KV cache dtype (--kv-cache-dtype; FP8 caches need CUDA)."""
        if self.args.cache.kv_cache_dtype != "auto" and self.device.type != "cuda":
            raise UsageError(f"--kv-cache-dtype {self.args.cache.kv_cache_dtype} needs a CUDA GPU")
        return KV_CACHE_DTYPES.get(self.args.cache.kv_cache_dtype, self.dtype)

    def _graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes captured in CUDA graphs ([] when graphs are off)."""
        if self.device.type != "cuda" or self.args.kernels.disable_cuda_graph:
            return []
        limit = self.max_running_requests * self._rows_per_request()
        sizes = [b for b in self.args.kernels.cuda_graph_batch_sizes(self.max_running_requests) if b <= limit]
        return sizes or [1]

    def _rows_per_request(self) -> int:
        """Decode-batch rows one running request can take: 1, or with speculative decoding one per
        draft-tree node (verify), per top-k frontier node (draft) or per pending position (draft KV)."""
        spec = self.args.speculative
        return max(spec.speculative_num_draft_tokens, spec.speculative_eagle_topk) if spec.enabled else 1

    # ---- construction ------------------------------------------------------
    def _fp8_block(self) -> Optional[tuple[int, int]]:
        cfg, q = self.resolved.config, self.args.model.quantization
        if q == "fp8" and cfg.fp8 is not None:
            raise UsageError(
                "--quantization fp8: this checkpoint is already block-FP8 and is served as FP8 by default; "
                "drop the flag (or use --quantization none to dequantise it)"
            )
        if q == "none" or self.device.type != "cuda":
            return None  # dequantise (CPU has no FP8 matmul)
        if cfg.fp8 is not None:
            return (cfg.fp8.block_n, cfg.fp8.block_k)
        return WEIGHT_BLOCK if q == "fp8" else None

    def _build_model(self, draft: Optional[Callable[[ModelRunner], Draft]]) -> None:
        """This rank's model and MTP layer (engine/model/builder.py), sharded over the TP group; with `draft`,
        the draft's MTP layer (the checkpoint's own or another's) is the one kept."""
        r = self.resolved
        self.model, self.mtp = build_model(r.config, self.num_layers, self.dtype, self.device, self.fp8_block,
                                           self.parallel.tp, checkpoint=None if r.dummy else r.path,
                                           seed=self.args.model.seed, kernels=self.kernels,
                                           placement=self._expert_placement())
        self.draft = draft(self) if draft is not None else None
        if self.draft is not None:
            self.mtp = self.draft.layer

    def _expert_placement(self) -> Optional[ExpertPlacement]:
        """--expert-placement, read and checked against the model and the EP size (None without it)."""
        path = self.args.parallel.expert_placement
        if path is None:
            return None
        return placement_for(path, self.resolved.config, self.parallel.tp.ep_size)

    def _expert_load(self) -> Optional[ExpertLoad]:
        """--record-expert-load: the routing counts of every MoE layer (main model and MTP layer)."""
        if not self.args.parallel.record_expert_load:
            return None
        modules = [self.model] + ([self.mtp] if self.mtp is not None else [])
        slots = {m.layer: m.slots or tuple(range(self.config.n_routed_experts))
                 for mod in modules for m in mod.modules() if isinstance(m, MoE)}
        return ExpertLoad(slots, self.config.n_routed_experts, self.parallel.tp.ep_size, self.device)

    @property
    def records_expert_load(self) -> bool:
        """--record-expert-load is on."""
        return self.forward_ctx.expert_load is not None

    def reset_expert_load(self) -> None:
        """Start the routing counts afresh (after the start-up's warm-up forwards); nothing when not recorded."""
        if self.forward_ctx.expert_load is not None:
            self.forward_ctx.expert_load.reset()

    def expert_load_report(self) -> Optional[ExpertLoadReport]:
        """The job's routing counts since ready (a collective: every rank calls it at the same point); None when
        not recorded."""
        load = self.forward_ctx.expert_load
        if load is None:
            return None
        return load.report(load.totals(self.parallel.tp))

    def _dp_sync(self) -> Optional[DPSync]:
        """DP attention's per-forward agreement with the other groups (engine/distributed/dp_sync.py), or
        None without DP attention."""
        if self.parallel.tp.dp_size == 1:
            return None
        dp = DPSync(self.parallel.tp, self._set_gather)
        dp.add_idle(TARGET, IdleForward(self._idle_forward, self._replay_padding, self._replay_piecewise_idle))
        return dp

    @property
    def kv_row_dim(self) -> int:
        """Cached values per token per layer: the latent, or this rank's expanded heads with --disable-mla."""
        return kv_row_dim(self.config, self.setup.local_heads, self.setup.expanded_kv)

    def _init_memory(self) -> None:
        cfg = self.config
        cache_layers = self.num_layers + (1 if self.mtp is not None else 0)
        kv_dtype = self.setup.kv_dtype
        self.req_to_token = ReqToTokenPool(self.max_running_requests, self.max_model_len + 1, self.device)
        size = self.args.cache.max_total_tokens or self._default_kv_tokens(cache_layers, kv_dtype)
        # every rank of a TP (or DP-attention) group holds the same token slots; DP groups have their own pools
        size = all_reduce_min_int(size, self.parallel.tp.attention)
        if self.device.type == "cuda" and self.args.cache.max_total_tokens is None:
            self._check_pool(size)
        self.kv_pool = KVPool(cache_layers, size, self.kv_row_dim, kv_dtype, self.device)
        rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, self.max_model_len + 1, self.device)
        prefill = PREFILL_ATTENTION.build(self.kernel_choice.prefill_attention, self.setup)
        attention = ATTENTION.build(self.kernel_choice.attention, self.setup, self.kv_pool, self.req_to_token, prefill)
        moe = MOE.build(self.kernel_choice.moe, self.setup)
        self.forward_ctx = ForwardContext(self.kv_pool, self.req_to_token, rotary, attention, moe,
                                          expanded_kv=self.setup.expanded_kv, expert_load=self._expert_load(),
                                          two_batch=self._two_batch())

    def _two_batch(self) -> Optional[TwoBatchOverlap]:
        """--enable-two-batch-overlap: which forwards run as two micro-batches (None: off)."""
        par = self.args.parallel
        return TwoBatchOverlap(par.two_batch_overlap_min_tokens) if par.enable_two_batch_overlap else None

    def _default_kv_tokens(self, cache_layers: int, kv_dtype: torch.dtype) -> int:
        """KV tokens that fit in --mem-fraction-static of the GPU after the weights (CPU: a fixed default)."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS
        per_token = cache_layers * self.kv_row_dim * torch.finfo(kv_dtype).bits // 8
        # the tensors that the weight merges and the shared-expert fusion replaced are free but cached: give them
        # back first, or the driver counts them as used (V2 at TP 2 on 2 x H200 got a pool of 145k tokens where
        # the memory plan had 193k: about the 3 GB those merges free at 60 layers)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # the memory plan's rule (engine/memory/plan.py); too few tokens: `_check_pool` refuses, with the fixes
        return kv_pool_tokens(total, total - free, self.args.cache.mem_fraction_static, per_token)

    def _memory_held_elsewhere(self) -> float:
        """Bytes other processes hold on the busiest GPU of the group before any weight is read (a server still
        exiting, another job; 0 on CPU). Where the memory plan no longer fits beside them, refuse now with the
        reason and the fixes (every rank the same verdict), not with an out-of-memory error while loading."""
        if self.device.type != "cuda":
            return 0.0
        free, total = torch.cuda.mem_get_info(self.device)
        tp = self.parallel.tp
        mine = used_by_others(total, free, communicators=tp.size > 1, dp_attention=tp.dp_size > 1)
        others = float(-all_reduce_min_int(-int(mine), tp))
        if others >= OTHERS_NOTED:
            r = self.resolved
            mtp = has_mtp_layer(r.config, None if r.dummy else r.path)
            verdict = judge(plan_memory(self._plan_spec(total, others, mtp)))
            if not verdict.fits:
                raise UsageError(verdict.reason)
        return others

    def _plan_spec(self, gpu_bytes: float, others: float, mtp: bool) -> PlanSpec:
        """The memory plan's input for this rank's layout on a GPU of `gpu_bytes`, `others` held elsewhere."""
        tp = self.parallel.tp
        return spec_from_args(self.args, self.config, tp=tp.size, dp=tp.dp_size, ep=tp.ep_size,
                              fp8_block=self.fp8_block, mtp=mtp,
                              gpu_bytes=gpu_bytes, gpu_used_bytes=others,
                              gpus_per_node=max(1, torch.cuda.device_count()))

    def _check_pool(self, size: int) -> None:
        """The memory plan's rules (engine/memory/plan_check.py) on the pool just sized, with the smallest DP
        group's real token count: refuse (UsageError naming the fixes and their KV tokens), or serve with the
        context limit it allows; the warnings are logged by rank 0."""
        pool = all_reduce_min_int(size, self.parallel.tp)
        spec = self._plan_spec(torch.cuda.mem_get_info(self.device)[1], self.others_bytes, self.mtp is not None)
        verdict = judge(plan_memory(spec), pool=pool)
        if not verdict.fits:
            raise UsageError(verdict.reason)
        if self.parallel.world_rank == 0:
            for warning in verdict.warnings:
                log.warning(warning)
        self.max_model_len = verdict.context_limit

    def build_graph_runner(self, batch_sizes: list[int], capture: bool = True) -> None:
        """Decode at `batch_sizes` through padded static batches: CUDA graphs (torch.compile'd below
        --torch-compile-max-bs when enabled) of the model, then of the draft; capture=False runs them
        eagerly (CPU tests)."""
        if self._compiles(capture):
            # lazy: inductor (and Triton under it) loads only for torch.compile, a CUDA path
            import torch._inductor.config as inductor_config

            # Round intermediates to bf16 where eager does, so compiled decode matches eager greedy output.
            inductor_config.emulate_precision_casts = True
            _raise_recompile_limits()
        if self.draft is not None:  # tree forwards run through the graphs with their KV lists in scratch rows
            self.req_to_token.reserve_scratch(max(batch_sizes))
        self.forward_ctx.reserve_padding(self.parallel.tp.dp_size * max(batch_sizes), self.device, captured=capture)
        with torch.inference_mode():
            self.graphs = self.graph_runner(self._forward_eager, batch_sizes, capture,
                                            record_scope=self.model.representative_layers)
            if self.dp is not None:
                self.dp.graph_sizes = self.graphs.sizes
            if self.draft is not None:
                self.draft.build_graphs(batch_sizes, capture)

    def _piecewise_sizes(self) -> list[int]:
        """Token buckets of the extend steps' piecewise CUDA graphs ([] where they are off: no CUDA graphs,
        --disable-mla, two-batch overlap (its micro-batches run eagerly), or --piecewise-cuda-graph-max-tokens
        0)."""
        off = self.setup.expanded_kv or self.forward_ctx.two_batch is not None
        if not self.setup.cuda_graphs or off:
            return []
        return bucket_sizes(self.args.piecewise_max_tokens())

    def build_piecewise(self, sizes: list[int], capture: bool = True) -> None:
        """Extend steps of up to max(sizes) tokens through piecewise CUDA graphs (engine/runner/piecewise_graph.py);
        capture=False runs the same cut eagerly (CPU tests)."""
        prepare = self.dp.prepare_graph if self.dp is not None else None  # DP: each bucket's uniform gather
        self.forward_ctx.reserve_padding(self.parallel.tp.dp_size * max(sizes), self.device, captured=capture)
        with torch.inference_mode():
            self.piecewise = PiecewiseGraphs(self.model, self.forward_ctx, sizes, self.req_to_token.padding_row,
                                             self.device, capture=capture, prepare=prepare,
                                             groups=self.parallel.tp.dp_size)
        if self.dp is not None:
            self.dp.piecewise_sizes = self.piecewise.sizes

    @property
    def extend_buckets(self) -> tuple[int, ...]:
        """The token counts extend steps replay piecewise graphs at (a step pads to the next one); () if none."""
        return self.piecewise.sizes if self.piecewise is not None else ()

    def graph_runner(self, forward: EagerForward, batch_sizes: list[int], capture: bool,
                     spec_hidden: Optional[tuple[int, torch.dtype]] = None,
                     record_scope: Callable[[], ContextManager] = nullcontext) -> CudaGraphRunner:
        """CUDA graphs of `forward` (the model's or the draft's) at `batch_sizes`, over this runner's request
        table and forward context; spec_hidden: (width, dtype) of an MTP layer's hidden-state input;
        record_scope: around the Triton precompile's recording forwards."""
        compiled = torch.compile(forward, dynamic=False) if self._compiles(capture) else None
        return CudaGraphRunner(forward, batch_sizes, self.req_to_token.padding_row, self.device,
                               compiled_forward=compiled, compile_max_bs=self.args.kernels.torch_compile_max_bs,
                               prepare=self._prepare_graph, capture=capture, spec_hidden=spec_hidden,
                               compile_workers=self.compile_workers if capture else 0, record_scope=record_scope)

    def _compiles(self, capture: bool) -> bool:
        return capture and self.args.kernels.enable_torch_compile

    def _triton_compile_workers(self) -> int:
        """--triton-compile-workers, default: this rank's share of the CPUs (ranks of a node share them)."""
        workers = self.args.kernels.triton_compile_workers
        if workers is not None:
            return workers
        return default_workers(min(self.parallel.world_size, max(1, torch.cuda.device_count())))

    def _record_prefill(self) -> list:
        """The Triton kernels (engine/runner/triton_precompile.py `record`) of `prefill_forwards`, compiled after
        the decode graphs' capture."""
        with torch.inference_mode(), self.model.representative_layers():  # the same kernels as every layer's
            kernels = record(self.prefill_forwards())
        torch.cuda.synchronize(self.device)
        return kernels

    def prefill_forwards(self) -> list[Callable[[], None]]:
        """The extend steps a server runs, at the token counts that a kernel config or specialisation tells apart
        (up to a DP group's share of the step budget): one request of n new tokens, one of n new tokens on a
        cached prefix of n (the prefix's expansion), and n requests of one new token on a cached token (a mixed
        step's decode rows, attending in latent space); all over the scratch slot. Every rank runs the same
        ones: under DP attention each gathers every group's rows at the forward's own width (`uniform`), as a
        CUDA graph's capture does."""
        cap = min(self.args.group_step_budget(), self.max_model_len)
        pad = self.req_to_token.padding_row

        def run(reqs: int, prefix: int, n: int) -> None:
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * (reqs * n), [pad] * reqs, [prefix] * reqs, [n] * reqs,
                                    torch.zeros(reqs * n, dtype=torch.int64), [reqs * n - 1], self.device)
            if self.dp is not None:
                self.dp.prepare_graph(reqs * n)
            self.forward_ctx.begin_forward(fb)
            self._forward_eager(fb)

        buckets = {n for n in self._piecewise_sizes() if n <= cap}  # what the piecewise graphs' capture runs
        counts = sorted(set(prefill_token_counts(cap)) | buckets)
        forwards = [functools.partial(run, 1, 0, n) for n in counts]
        forwards += [functools.partial(run, 1, n, n) for n in counts if 2 * n <= self.max_model_len]
        forwards += [functools.partial(run, n, 1, 1) for n in counts if n <= self.max_running_requests]
        return forwards

    def close(self) -> None:
        """The process is about to end: stop the background kernel compiles and free the CUDA graphs (before
        the process group goes: `CudaGraphRunner.release`). The runner cannot forward after this."""
        if self.prefill_compiles is not None:
            self.prefill_compiles.cancel()
        if self.graphs is not None:
            self.graphs.release()
        if self.piecewise is not None:
            self.piecewise.release()
            self.piecewise = None
        if self.draft is not None:
            self.draft.release()
        self.graphs = None
        if self.dp is not None:
            self.dp.graph_sizes = self.dp.piecewise_sizes = ()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- forward -----------------------------------------------------------
    def _forward_eager(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.hidden_states(fb, self.forward_ctx)
        return self.model.logits(hidden[fb.logits_indices]), hidden

    def _prepare_graph(self, fb: ForwardBatch, bs: int) -> None:
        """Before a CUDA graph's capture or replay (fb: its padded static batch of size bs): under DP attention
        the gather every group records at that padded size, then the backends' host planning, then the padding rows
        (every group's under DP attention), which the MoE layers route to no expert (at capture, fb.real_tokens
        None: none)."""
        if self.dp is not None:
            self.dp.prepare_graph(bs)
        self.forward_ctx.begin_forward(fb, bs)
        groups = self.parallel.tp.dp_size
        if fb.real_tokens is None:
            real = [bs] * groups
        else:
            real = self.dp.real if self.dp is not None else [fb.real_tokens]
        self.forward_ctx.mask_padding(real, bs)

    @property
    def dp_attention(self) -> bool:
        return self.dp is not None

    def _set_gather(self, gather: DPGather) -> None:
        self.forward_ctx.dp = gather

    def idle_batch(self) -> ForwardBatch:
        """A batch of no tokens: a DP-attention group's share of a forward other groups run, eagerly (the
        context's static shapes off, as every other rank's eager forward has them)."""
        self.forward_ctx.static_shapes = False
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return ForwardBatch.build(ForwardMode.IDLE, [], [], [], [], empty, [], self.device)

    def _idle_forward(self) -> None:
        """Every layer's gather / MLP / scatter with no tokens of this group's (attention is skipped)."""
        fb = self.idle_batch()
        self.forward_ctx.begin_forward(fb)  # under two-batch overlap: join the other groups' micro-batches
        self.model.hidden_states(fb, self.forward_ctx)

    def _replay_padding(self, bs: int) -> None:
        self.graphs.replay_padding(bs)

    def _replay_piecewise_idle(self, n: int) -> None:
        self.piecewise.replay_idle(n, self.idle_batch(), self.dp.real)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        return self.run_forward(TARGET, fb, self.graphs, self._forward_eager)

    def run_forward(self, kind: int, fb: ForwardBatch, graphs: Optional[CudaGraphRunner],
                    eager: EagerForward) -> ForwardOutput:
        """One forward of `kind` (dp_attention.TARGET: the model; MTP: the draft, engine/speculative/): the CUDA
        graph when one holds fb, else (the model's) the piecewise graphs when they do, else eagerly; under DP
        attention, the path and the padded size every group agreed on."""
        graphable = graphs is not None and graphs.can_run(fb)
        pieces = kind == TARGET and self.piecewise is not None and self.piecewise.can_run(fb)
        graph_bs = pieces_bs = real = None
        if self.dp is not None:
            split = split_point(fb)[1] if kind == TARGET and self.forward_ctx.two_batch is not None else 0
            agreed = self.dp.before_forward(kind, fb.num_tokens, graphable, split, pieces)
            graph_bs, pieces_bs, real = agreed.graph_bs, agreed.piecewise_bs, agreed.real
            graphable, pieces = graph_bs is not None, pieces_bs is not None
        if graphable:
            logits, hidden = graphs.replay(fb, graph_bs)
        elif pieces:
            logits, hidden = self.piecewise.replay(fb, pieces_bs, real)
        else:
            self.forward_ctx.begin_forward(fb)
            logits, hidden = eager(fb)
        if kind == TARGET:
            self.count_forward("cuda_graph" if graphable else "piecewise" if pieces else "eager")
        self.two_batch_forwards += self.forward_ctx.micro is not None
        return ForwardOutput(logits=logits, hidden=hidden)

    def count_forward(self, path: str) -> None:
        """One more of the model's own forwards (not the MTP draft's) run by `path`: cuda_graph, piecewise or eager
        (`/metrics` dsctl_forwards_total)."""
        self.forward_paths[path] = self.forward_paths.get(path, 0) + 1

    def share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Make every rank of the TP (DP attention: attention) group hold its rank 0's sampled token ids
        (in place; nothing to do in one process)."""
        return broadcast_tensor(tokens, 0, self.parallel.tp.attention)
