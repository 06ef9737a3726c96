"""ModelRunner: builds the model on its device, loads weights, owns the KV memory and runs forwards.

This is the only place that launches model forwards. It picks the device and
dtype, decides whether FP8 weights stay FP8 (CUDA W8A8) or are dequantised,
resolves the attention and MoE backends by name (engine/model/backends.py: 'auto',
start-up checks, factories), sizes the KV pool and request table, and builds the
`ForwardContext` every forward passes down the layers. It registers the tuned
kernel-config directory (--kernel-config-dir, default $DSCTL_KERNEL_CONFIG_DIR) with
kernels/tuned_configs.py.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

from engine.args import EngineArgs
from engine.distributed.comm import all_reduce_min_int, broadcast_tensor
from engine.distributed.dp_attention import MTP, TARGET
from engine.distributed.groups import ParallelState, single_process
from engine.errors import UsageError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.pools import KVPool, ReqToTokenPool, kv_row_dim
from engine.model.backends import ATTENTION_BACKENDS, MOE_BACKENDS, BackendSetup
from engine.model.context import ForwardContext
from engine.model.rope import RotaryEmbedding
from engine.resolve import ResolvedModel, resolve_model
from engine.triton_precompile import LateCompileLog, compile_in_background, default_workers, fresh_process, record
from kernels import tuned_configs
from kernels.fp8_math import WEIGHT_BLOCK
from kernels.interpret import interpreting

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DEFAULT_CPU_KV_TOKENS = 32768


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows = fb.logits_indices
    hidden: torch.Tensor  # [T, hidden] pre-norm hidden states of every token (MTP input)


@contextmanager
def _timed(into: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    into[name] = time.perf_counter() - start


def _raise_recompile_limits() -> None:
    """torch.compile specialises each layer's code per layer index and batch size, and every engine built in
    a process adds its own modules: past dynamo's default recompile limit (8 per code object) it falls
    back to eager mid-graph, which breaks CUDA-graph capture. Allow one compile per layer and size."""
    import torch._dynamo.config as dynamo_config

    for name, floor in (("recompile_limit", 1024), ("accumulated_recompile_limit", 8192)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), floor))


def prefill_token_counts(cap: int) -> list[int]:
    """Prefill token counts (at most `cap`) that cover the tuned configs' batch-size keys and Triton's
    integer specialisations (multiple of 16 or not) of the kernels a prefill step launches."""
    keys = [2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]  # above 4096: 4096's
    return sorted({m for k in keys for m in (k, k + 1) if m <= cap} | {min(cap, 4097)})


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: EngineArgs, resolved: Optional[ResolvedModel] = None,
                 parallel: Optional[ParallelState] = None):
        """`parallel`: this rank's place in the TP world (default: one process, nothing split)."""
        args.validate()
        self.args = args
        tuned_configs.set_user_config_dir(args.kernels.config_dir())
        self.resolved = resolved or resolve_model(args.model)
        cfg = self.resolved.config
        self.device = pick_device(args.model.device) if parallel is None else parallel.device
        self.parallel = parallel or single_process(self.device)
        self.dtype = pick_dtype(args.model.dtype, self.device)
        self.num_layers = args.model.num_layers or cfg.num_hidden_layers
        self.max_running_requests = args.scheduler.max_running_requests
        self.config = cfg.with_num_layers(self.num_layers)
        self.fp8_block = self._fp8_block()
        self.max_model_len = min(args.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.setup = BackendSetup(self.config, self.device, self.dtype, self._kv_dtype(),
                                  tuple(self._graph_batch_sizes()), interpreting(),
                                  tp_size=self.parallel.tp.attention.size, expanded_kv=args.kernels.disable_mla)
        self.attention_backend, self.moe_backend = self._pick_backends()
        phases = {}
        with _timed(phases, "weights"):
            self._build_model()
        with _timed(phases, "KV pool"):
            self._init_memory()
        self.graphs = self.mtp_graphs = self.prefill_compiles = None
        self.compile_workers = workers = self._triton_compile_workers() if self.device.type == "cuda" else 0
        if workers and not fresh_process():
            log.info("Triton kernels already compiled in this process: no parallel precompile")
            self.compile_workers = workers = 0
        prefill_kernels = []
        if workers and not self.dp_attention:
            with _timed(phases, "prefill kernels"):
                prefill_kernels = self._record_prefill()  # before the capture compiles anything in-process
        if self.setup.cuda_graphs:
            with _timed(phases, "CUDA graphs"):
                self.build_graph_runner(list(self.setup.graph_batch_sizes))
        if prefill_kernels:
            self.prefill_compiles = compile_in_background(prefill_kernels, workers)
        self.late_compiles = LateCompileLog()
        if self.device.type == "cuda":
            self.late_compiles.install()  # from here on a compile stalls a step: say which and how long
        self._report(phases)

    def _report(self, phases: dict[str, float]) -> None:
        """One start-up line per rank: its weight and KV bytes, KV tokens, and how long each phase took."""
        from engine.weights.loader import iter_params

        modules = {"": self.model, **({"mtp.": self.mtp} if self.mtp is not None else {})}
        unique = {p.data_ptr(): p for _, p in iter_params(modules)}  # the MTP layer may share embed / head
        weights = sum(p.numel() * p.element_size() for p in unique.values())
        kv = self.kv_pool.nbytes()
        log.info("rank %d: weights %.2f GB, KV pool %d tokens (%.2f GB); start-up %s", self.parallel.world_rank,
                 weights / 1e9, self.kv_pool.size, kv / 1e9,
                 ", ".join(f"{name} {secs:.1f} s" for name, secs in phases.items()))

    def _pick_backends(self) -> tuple[str, str]:
        """Backend names ('auto' resolved) after their start-up checks, which reject what cannot run here."""
        return (ATTENTION_BACKENDS.resolve(self.args.kernels.attention, self.setup),
                MOE_BACKENDS.resolve(self.args.kernels.moe_backend, self.setup))

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

    def _build_model(self) -> None:
        """This rank's model and MTP layer (engine/model/builder.py), sharded over the TP group."""
        from engine.model.builder import build_model

        r = self.resolved
        self.model, self.mtp = build_model(r.config, self.num_layers, self.dtype, self.device, self.fp8_block,
                                           self.parallel.tp, checkpoint=None if r.dummy else r.path,
                                           seed=self.args.model.seed)
        if self.args.speculative.enabled:
            from engine.speculative.draft_model import attach_draft

            self.mtp = attach_draft(self, self.mtp)

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
        self.kv_pool = KVPool(cache_layers, size, self.kv_row_dim, kv_dtype, self.device)
        rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, self.max_model_len + 1, self.device)
        attention = ATTENTION_BACKENDS.build(self.attention_backend, self.setup, self.kv_pool, self.req_to_token)
        moe = MOE_BACKENDS.build(self.moe_backend, self.setup)
        self.forward_ctx = ForwardContext(self.kv_pool, self.req_to_token, rotary, attention, moe,
                                          expanded_kv=self.setup.expanded_kv)

    def _default_kv_tokens(self, cache_layers: int, kv_dtype: torch.dtype) -> int:
        """KV tokens that fit in --mem-fraction-static of the GPU after the weights (CPU: a fixed default)."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS
        per_token = cache_layers * self.kv_row_dim * torch.finfo(kv_dtype).bits // 8
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.args.cache.mem_fraction_static - (total - free)
        if budget < per_token * 1024:
            raise UsageError(
                f"after loading the weights only {budget / 2**30:.1f} GiB of the --mem-fraction-static "
                f"{self.args.cache.mem_fraction_static} budget is left for the KV cache: raise it, use fewer "
                "--num-layers, or set --max-total-tokens")
        return int(budget // per_token)

    def build_graph_runner(self, batch_sizes: list[int], capture: bool = True) -> None:
        """Decode at `batch_sizes` through padded static batches: CUDA graphs (torch.compile'd below
        --torch-compile-max-bs when enabled); capture=False runs them eagerly (CPU tests)."""
        from engine.cuda_graph import CudaGraphRunner

        spec = self.args.speculative.enabled
        compiled = compiled_mtp = None
        if capture and self.args.kernels.enable_torch_compile:
            import torch._inductor.config as inductor_config

            # Round intermediates to bf16 where eager does, so compiled decode matches eager greedy output.
            inductor_config.emulate_precision_casts = True
            _raise_recompile_limits()
            compiled = torch.compile(self._forward_eager, dynamic=False)
            compiled_mtp = torch.compile(self._forward_mtp_eager, dynamic=False) if spec else None
        if spec:  # tree forwards run through the graphs with their KV lists in scratch rows
            self.req_to_token.reserve_scratch(max(batch_sizes))
        common = dict(batch_sizes=batch_sizes, padding_row=self.req_to_token.padding_row, device=self.device,
                      compile_max_bs=self.args.kernels.torch_compile_max_bs, prepare=self._prepare_graph,
                      capture=capture, compile_workers=self.compile_workers if capture else 0)
        with torch.inference_mode():
            self.graphs = CudaGraphRunner(self._forward_eager, compiled_forward=compiled, **common)
            if spec:
                self.mtp_graphs = CudaGraphRunner(self._forward_mtp_eager, compiled_forward=compiled_mtp,
                                                  spec_hidden=(self.config.hidden_size, self.dtype), **common)

    def _triton_compile_workers(self) -> int:
        """--triton-compile-workers, default: this rank's share of the CPUs (ranks of a node share them)."""
        workers = self.args.kernels.triton_compile_workers
        if workers is not None:
            return workers
        return default_workers(min(self.parallel.world_size, max(1, torch.cuda.device_count())))

    def _record_prefill(self) -> list:
        """The Triton kernels (engine/triton_precompile.py `record`) of prefill steps of the token counts
        that a kernel config or specialisation tells apart: one request of n scratch tokens each, compiled
        after the capture in the background. DP attention is left out: its eager forwards are agreed
        between the groups."""
        sched = self.args.scheduler
        cap = min(sched.chunked_prefill_size if sched.chunked_prefill_size > 0 else sched.max_prefill_tokens,
                  sched.max_prefill_tokens, self.max_model_len)

        def run(n: int) -> None:
            fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, [self.req_to_token.padding_row], [0], [n],
                                    torch.zeros(n, dtype=torch.int64), [n - 1], self.device)
            self.forward_ctx.begin_forward(fb)
            self._forward_eager(fb)

        with torch.inference_mode():
            kernels = record([lambda n=n: run(n) for n in prefill_token_counts(cap)])
        torch.cuda.synchronize(self.device)
        return kernels

    def close(self) -> None:
        """The process is about to end: stop the background kernel compiles and free the CUDA graphs (before
        the process group goes: `CudaGraphRunner.release`). The runner cannot forward after this."""
        if self.prefill_compiles is not None:
            self.prefill_compiles.cancel()
        for graphs in (self.graphs, self.mtp_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.mtp_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- forward -----------------------------------------------------------
    def _forward_eager(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.hidden_states(fb, self.forward_ctx)
        return self.model.logits(hidden[fb.logits_indices]), hidden

    def _forward_mtp_eager(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.mtp(fb, self.forward_ctx)
        return self.mtp.logits(hidden[fb.logits_indices]), hidden

    def _prepare_graph(self, fb: ForwardBatch, bs: int) -> None:
        """Before a CUDA graph's capture or replay (fb: its padded static batch of size bs): the backends'
        host planning and, under DP attention, the gathers every group records at that same padded size
        (`uniform`), so that they are fixed shapes."""
        if self.dp_attention:
            from engine.distributed.dp_attention import uniform

            self.forward_ctx.dp = uniform(self.parallel.tp, bs)
        self.forward_ctx.begin_forward(fb, bs)

    @property
    def dp_attention(self) -> bool:
        return self.parallel.tp.dp_size > 1

    def _agree_dp(self, kind: int, tokens: int, graphable: bool = False) -> Optional[int]:
        """DP attention (a no-op otherwise): before this rank's own forward of `kind` (dp_attention.MTP or
        TARGET), run the idle forwards of other kinds that other groups run first, until every group agrees
        on this kind; sets this forward's gather and returns the padded size whose CUDA graph every group
        replays, or None for an eager forward."""
        if not self.dp_attention:
            return None
        while True:
            agreed = self._agreement(kind, tokens, graphable)
            if agreed.kind == kind:
                return agreed.graph_bs
            self._idle_forward(agreed)

    def _agreement(self, kind: int, tokens: int, graphable: bool):
        from engine.distributed.dp_attention import agree

        sizes = self.graphs.sizes if self.graphs is not None else ()
        agreed = agree(kind, tokens, self.parallel.tp, sizes, graphable)
        self.forward_ctx.dp = agreed.gather
        return agreed

    @torch.inference_mode()
    def finish_dp_iteration(self) -> None:
        """DP attention, after this rank's step: join the forwards other groups still run (idle, with no
        tokens of its own) until every rank has none left, so that each iteration's collectives pair up."""
        from engine.distributed.dp_attention import DONE

        while (agreed := self._agreement(DONE, 0, True)).kind != DONE:
            self._idle_forward(agreed)

    @torch.inference_mode()
    def _idle_forward(self, agreed) -> None:
        """Every layer's gather / MLP / scatter with no tokens of this group's (attention is skipped), for a
        forward of the agreed kind that other groups run: the agreed CUDA graph on padding rows, or eagerly."""
        from engine.distributed.dp_attention import MTP

        if agreed.graph_bs is not None:
            (self.mtp_graphs if agreed.kind == MTP else self.graphs).replay_padding(agreed.graph_bs)
            return
        if agreed.gather.total == 0:
            return
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        fb = ForwardBatch.build(ForwardMode.IDLE, [], [], [], [], empty, [], self.device)
        if agreed.kind == MTP:
            fb.spec_hidden = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
            self.mtp(fb, self.forward_ctx)
        else:
            self.model.hidden_states(fb, self.forward_ctx)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        return self._run(TARGET, fb, self.graphs, self._forward_eager)

    def _run(self, kind: int, fb: ForwardBatch, graphs, eager) -> ForwardOutput:
        """One forward of `kind` (the model or the MTP layer): the CUDA graph when one holds fb (under DP
        attention: when every group's does, at the agreed size), else eagerly."""
        graphable = graphs is not None and graphs.can_run(fb)
        graph_bs = self._agree_dp(kind, fb.num_tokens, graphable)
        if graph_bs is not None or (graphable and not self.dp_attention):
            logits, hidden = graphs.replay(fb, graph_bs)
        else:
            self.forward_ctx.begin_forward(fb)
            logits, hidden = eager(fb)
        return ForwardOutput(logits=logits, hidden=hidden)

    def share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Make every rank of the TP (DP attention: attention) group hold its rank 0's sampled token ids
        (in place; nothing to do in one process)."""
        return broadcast_tensor(tokens, 0, self.parallel.tp.attention)

    @torch.inference_mode()
    def forward_tree(self, fb: ForwardBatch, table, mtp: bool = False) -> ForwardOutput:
        """Speculative decoding: a decode-mode forward of the model (or, with `mtp`, the MTP layer) whose row i
        attends to the KV slots of row i of `table` (engine/speculative/tree_table.py: one KV index list
        per tree node). The lists go to the request table's scratch rows, so the decode CUDA graphs run
        it; when they do not fit there, it runs eagerly with `table` in place of the request table."""
        from dataclasses import replace

        rows = self.req_to_token.write_scratch(table.table)
        if rows is not None:
            fb = replace(fb, req_pool_indices=rows, req_rows_cpu=None)  # the host copy would be stale
            return self.forward_mtp(fb) if mtp else self.forward(fb)
        self._agree_dp(MTP if mtp else TARGET, fb.num_tokens)
        ctx = replace(self.forward_ctx, req_to_token=table)
        ctx.begin_forward(fb)
        if mtp:
            hidden = self.mtp(fb, ctx)
            return ForwardOutput(logits=self.mtp.logits(hidden[fb.logits_indices]), hidden=hidden)
        hidden = self.model.hidden_states(fb, ctx)
        return ForwardOutput(logits=self.model.logits(hidden[fb.logits_indices]), hidden=hidden)

    @torch.inference_mode()
    def forward_mtp(self, fb: ForwardBatch) -> ForwardOutput:
        """The MTP layer: a draft-KV extend (eager) or a decode-mode batch (its CUDA graph when one holds it)."""
        if self.mtp is None:
            raise UsageError("this checkpoint has no MTP/NextN layer (num_nextn_predict_layers = 0)")
        return self._run(MTP, fb, self.mtp_graphs, self._forward_mtp_eager)
