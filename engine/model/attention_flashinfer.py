"""FlashInfer MLA attention backend (optional dependency: `pip install flashinfer-python`).

Extend and decode both run the absorbed formulation through FlashInfer's
`BatchMLAPagedAttentionWrapper` (with `decode_only`, the 'flashinfer-decode' backend, only decode
steps do, and not those whose batch size this GPU's tuned MLA decode table gives the Triton kernel;
every other forward runs the Triton backend's extend, which at DeepSeek's 128 heads
attends prefills in the expanded form at a third of the absorbed form's FLOPs): the query is
folded into latent space with W_UK (the FP8 bmm when the weights are FP8), attention reads the
paged latent cache in place (page size 1: one KV-pool slot per page; the pool's [slot, 576] rows are
passed as one packed tensor), and the latent output goes back through W_UV.
Extend is causal with each request's queries aligned to the end of its KV (the
cached prefix plus the new tokens, which MLA.forward has already written).

FlashInfer plans on the host once per forward and every layer reuses that plan:
`begin_forward(fb)` plans before an eager forward. For CUDA graphs, each captured
batch size gets its own wrapper whose metadata buffers stay at fixed addresses;
it is planned before capture and re-planned (host side, outside the graph)
before every replay with the padded batch's lengths. A CUDA-graph wrapper reads the
request table in place: its page list is the whole table, flattened, and request i's
pages start at its row (kv_indptr[i] = row * row stride, lengths from kv_len_arr), so
a replay copies no page indices; this needs the re-plan of FlashInfer 0.7's planner
internals (`_replan_internals`), without which the wrappers gather each step's pages
into a buffer of their own and plan through the public plan().

FlashInfer is imported lazily, only when this backend is built on a CUDA device.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch

from engine.errors import UsageError
from engine.forward_batch import ForwardBatch
from engine.model.attention import MLA
from engine.model.attention_triton import TritonAttentionBackend, absorbed_query, latent_to_values
from engine.model.context import ForwardContext
from kernels.mla_decode import tuned_entry
from kernels.tuned_configs import MLA_KV_NAMES

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace (split-KV partial outputs); one for all wrappers
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
INSTALL_HINT = "pip install flashinfer-python"


def check_supported(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                    kv_lora_rank: int, rope_dim: int) -> None:
    """Raise UsageError (why, and what to use instead) when FlashInfer MLA cannot run this setup."""
    instead = "or use --attention-backend triton (the CUDA default)"
    if device.type != "cuda":
        raise UsageError("--attention-backend flashinfer needs a CUDA GPU; on CPU use --attention-backend torch")
    if importlib.util.find_spec("flashinfer") is None:
        raise UsageError(f"--attention-backend flashinfer: FlashInfer is not installed ({INSTALL_HINT}), {instead}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise UsageError(f"--attention-backend flashinfer: FlashInfer's MLA kernels take bfloat16/float16 "
                         f"activations, not {dtype}; use --dtype bfloat16, {instead}")
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"--attention-backend flashinfer: FlashInfer's MLA kernels read FP8 caches as e4m3 only "
                         f"(got {kv_dtype}); use --kv-cache-dtype fp8_e4m3, {instead}")
    if (kv_lora_rank, rope_dim) != (512, 64):
        raise UsageError(f"--attention-backend flashinfer: FlashInfer's MLA kernels are built for DeepSeek's "
                         f"kv_lora_rank 512 + rope 64, this model has {kv_lora_rank} + {rope_dim}; {instead}")


def csr_lengths(extend_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host int32 qo_indptr [B+1], kv_indptr [B+1], kv_lens [B] for a batch (page size 1: pages = tokens)."""
    def indptr(lens):
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
        return out

    return indptr(extend_lens), indptr(seq_lens), torch.tensor(seq_lens, dtype=torch.int32)


def kv_page_indices(table: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor, total: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate table[row, :len] over the batch (int32, on the table's device, no host sync).

    `total` is sum(seq_lens), known on the host; `out` (at least `total` long) receives the result."""
    seq_lens = seq_lens.to(torch.int64)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    rows = torch.repeat_interleave(req_rows.to(torch.int64), seq_lens, output_size=total)
    pos = torch.arange(total, device=table.device) - torch.repeat_interleave(starts, seq_lens, output_size=total)
    pages = table[rows, pos]
    if out is None:
        return pages.to(torch.int32)
    out[:total].copy_(pages)
    return out[:total]


def _replan_internals(wrapper):
    """(planned backend, planner, whether it returns staged schedule bytes that the caller copies to the GPU) of a
    wrapper FlashInfer has planned, from FlashInfer 0.7's MLA internals (the fa2/fa3 backend object and its JIT
    module: the raw planner under its staging proxy where there is one); None where this FlashInfer lacks them."""
    b = getattr(wrapper, "_planned_backend", None)
    module = getattr(b, "_cached_module", None)
    if module is None or not hasattr(module, "plan_with_staged_workspace_bytes"):
        return None
    raw = getattr(module, "_module", None)
    if raw is not None and callable(getattr(raw, "plan", None)):
        return b, raw.plan, True
    return b, module.plan_with_staged_workspace_bytes, False


class FlashInferAttentionBackend:
    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, sm_scale: float, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, kv_scale: float, device: torch.device, max_context: int,
                 max_graph_bs: int = 0, decode_only: bool = False, prefill=None):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # lazy: flashinfer is CUDA-only

        self._wrapper_cls, self._metadata_cls = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.sm_scale, self.q_dtype, self.kv_dtype, self.device = sm_scale, q_dtype, kv_dtype, device
        self.max_context, self.max_graph_bs = max_context, max_graph_bs
        self.decode_only = decode_only  # extend-like forwards (prefill, verification) run the Triton backend
        # FlashInfer's FP8 MLA multiplies by these per-tensor scales (stored * scale = value, as in KVPool).
        self.kv_scales = dict(ckv_scale=kv_scale, kpe_scale=kv_scale) if kv_dtype.itemsize == 1 else {}
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.eager = BatchMLAPagedAttentionWrapper(self.workspace)
        self.graph_wrappers: dict[int, object] = {}
        self.graph_indices: Optional[torch.Tensor] = None  # page indices shared by the gathering graph wrappers
        self.in_place: Optional[bool] = None  # graph wrappers read the request table in place (None: not yet known)
        self._table: Optional[torch.Tensor] = None  # the request table the in-place wrappers read
        self._decodes: dict[int, bool] = {}  # decodes_at's answers (the tuned table is read once per batch size)
        self.active = None  # the wrapper planned for the forward in flight
        # extends FlashInfer's planner refuses; FlashInfer runs DeepSeek's head dims only (qk_nope 128, v 128)
        # (prefill: the expanded prefill attention that backend's extends run, engine/model/prefill_attention.py)
        self.fallback = TritonAttentionBackend(num_heads * (128 + rope_dim + 128) * q_dtype.itemsize, prefill=prefill)
        self._plan_copied = None  # CUDA event recorded after the last plan's host-to-device copy
        self._pinned: Optional[torch.Tensor] = None  # page-locked staging of the plan's host arrays (_staged)
        # False before the first graph batch: gathering wrappers planned by FlashInfer's public plan() at every replay
        # (benchmarks compare; in-place wrappers never use plan() after their first, capture-time one)
        self.fast_replan = True
        self._warned_fallback = False
        if decode_only:
            self._log_triton_decodes(max(max_graph_bs, 256))

    # ---- planning (host side, once per forward) -------------------------------------------
    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: Optional[int] = None) -> None:
        """Plan the wrapper for this batch; with graph_bs, the CUDA-graph wrapper of that padded size."""
        if fb.batch_size == 0:
            self.active = None
            return
        if self.decode_only and not (fb.mode.is_decode and self.decodes_at(graph_bs or fb.batch_size)):
            self.active = None
            self.fallback.begin_forward(fb, ctx)
            return
        if self._plan_copied is not None:
            # FlashInfer's plan writes the schedule into a pinned host buffer and copies it to the GPU
            # asynchronously: wait until the previous plan's copy has left that buffer before rewriting
            # it (with overlap scheduling the host plans step N+1 while step N is still queued).
            self._plan_copied.synchronize()
        self._plan(fb, ctx, graph_bs)
        if self.device.type == "cuda":
            self._plan_copied = self._plan_copied or torch.cuda.Event()
            self._plan_copied.record()

    def decodes_at(self, batch: int) -> bool:
        """Whether FlashInfer runs a decode step of `batch` requests: yes, unless this GPU's tuned MLA decode table
        (`dsctl tune-mla`) measured the Triton kernel faster at that batch size (then the Triton backend decodes,
        with the table's launch parameters). Always yes for the full 'flashinfer' backend."""
        if not self.decode_only:
            return True
        if batch not in self._decodes:
            entry = tuned_entry(self.num_heads, self.kv_dtype, batch, self.device)
            self._decodes[batch] = entry is None or bool(entry.get("FLASHINFER", 1))
        return self._decodes[batch]

    def _log_triton_decodes(self, largest: int) -> None:
        """Say at start-up which decode batch sizes (powers of two up to `largest`) this GPU's MLA table gives to
        the Triton kernel, so that an operator who asked for FlashInfer's decode knows where it does not run."""
        sizes = [1 << i for i in range(largest.bit_length()) if not self.decodes_at(1 << i)]
        if sizes:
            log.info("flashinfer-decode: this GPU's MLA decode table (dsctl tune-mla) measured the Triton kernel "
                     "faster at %d heads, %s cache, for decode batch sizes near %s: those steps decode with Triton",
                     self.num_heads, MLA_KV_NAMES.get(self.kv_dtype, self.kv_dtype), ", ".join(map(str, sizes)))

    def _plan(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: Optional[int]) -> None:
        # in-place wrappers hold the request table as their page list: never planned through the gathering path
        if graph_bs is not None and (self.in_place or (self.in_place is None and self.fast_replan)):
            if self._plan_in_place(fb, ctx.req_to_token.table, graph_bs):
                return
        wrapper = self.eager if graph_bs is None else self._graph_wrapper(graph_bs)
        qo_indptr, kv_indptr, kv_lens = self._staged(csr_lengths(fb.extend_lens_cpu, fb.seq_lens_cpu))
        total = int(kv_indptr[-1])
        out = self.graph_indices if graph_bs is not None else None
        indices = kv_page_indices(ctx.req_to_token.table, fb.req_pool_indices, fb.seq_lens, total, out)
        replan = graph_bs is not None and self.fast_replan
        if replan and self._replan_captured(wrapper, qo_indptr, kv_indptr, kv_lens):
            self.active = wrapper
            return
        try:
            wrapper.plan(metadata=self._metadata_cls.csr(qo_indptr, kv_indptr, indices, kv_lens),
                         **self._plan_kwargs(causal=not fb.mode.is_decode))
        except Exception as e:  # FlashInfer's planner refuses some very long causal extends
            if fb.mode.is_decode:
                raise
            self._warn_fallback(e)
            self.active = None
            self.fallback.begin_forward(fb, ctx)
            return
        self.active = wrapper

    def _plan_in_place(self, fb: ForwardBatch, table: torch.Tensor, bs: int) -> bool:
        """Plan the in-place CUDA-graph wrapper of size bs for fb (see the module docstring); False (and from then
        on the gathering wrappers) when this FlashInfer cannot re-plan such a wrapper or the table is too large
        for int32 page offsets."""
        wrapper = self.graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._in_place_wrapper(table, bs)
            if wrapper is None:
                self.in_place = False
                return False
        if table is not self._table:
            raise RuntimeError("the request table was reallocated after FlashInfer's CUDA-graph wrappers were "
                               "built over it (ReqToTokenPool.reserve_scratch must run before graph capture)")
        rows = fb.host_req_rows()
        lens = fb.seq_lens_cpu
        kv_indptr = [r * table.stride(0) for r in rows]
        kv_indptr.append(kv_indptr[-1] + lens[-1])  # one past the last request's pages (unread by the planner)
        qo_indptr, kv_indptr, kv_lens = self._staged((list(range(bs + 1)), kv_indptr, lens))
        self._replan(_replan_internals(wrapper), qo_indptr, kv_indptr, kv_lens)
        self.active = wrapper
        return True

    def _in_place_wrapper(self, table: torch.Tensor, bs: int):
        """A CUDA-graph wrapper of size bs whose page list is `table` flattened, planned once through the public
        plan() (its first bs entries as a CSR of one page per request: FlashInfer accepts a source that is exactly
        the target it reserved), or None when this FlashInfer's internals do not allow re-planning it."""
        if table.numel() >= 2**31 or not table.is_contiguous() or table.dtype != torch.int32:
            return None
        if self._table is None:
            self._table = table
        i32 = dict(dtype=torch.int32, device=self.device)
        flat = table.view(-1)
        wrapper = self._wrapper_cls(self.workspace, use_cuda_graph=True, qo_indptr=torch.zeros(bs + 1, **i32),
                                    kv_indptr=torch.zeros(bs + 1, **i32), kv_indices=flat,
                                    kv_len_arr=torch.zeros(bs, **i32))
        ones = torch.arange(bs + 1, dtype=torch.int32)
        wrapper.plan(metadata=self._metadata_cls.csr(ones, ones, flat[:bs], torch.ones(bs, dtype=torch.int32)),
                     **self._plan_kwargs(causal=False))
        if _replan_internals(wrapper) is None:
            return None
        self.in_place = True
        self.graph_wrappers[bs] = wrapper
        return wrapper

    def _plan_kwargs(self, causal: bool) -> dict:
        return dict(num_heads=self.num_heads, head_dim_ckv=self.kv_lora_rank, head_dim_kpe=self.rope_dim,
                    page_size=1, causal=causal, sm_scale=self.sm_scale, q_data_type=self.q_dtype,
                    kv_data_type=self.kv_dtype, query_layout="split", kv_cache_layout="packed")

    def _staged(self, arrays: tuple) -> tuple[torch.Tensor, ...]:
        """The plan's host int32 arrays (lists or tensors) in one page-locked buffer kept across steps (on CUDA), so
        that their copies to the GPU do not wait for queued work and no step allocates page-locked memory.
        Rewriting it is safe: begin_forward waits for the previous plan's copies first."""
        if self.device.type != "cuda":
            return tuple(torch.as_tensor(a, dtype=torch.int32) for a in arrays)
        need = sum(len(a) for a in arrays)
        if self._pinned is None or self._pinned.numel() < need:
            self._pinned = torch.empty(max(need, 2 * (self.max_graph_bs + 1) + self.max_graph_bs + 64),
                                       dtype=torch.int32, pin_memory=True)
        flat = self._pinned.numpy()
        out, at = [], 0
        for a in arrays:
            flat[at:at + len(a)] = a.numpy() if isinstance(a, torch.Tensor) else a
            out.append(self._pinned[at:at + len(a)])
            at += len(a)
        return tuple(out)

    def _replan_captured(self, wrapper, qo_indptr, kv_indptr, kv_lens) -> bool:
        """Re-plan a CUDA-graph wrapper that was planned before: the schedule only, without the public
        plan()'s validation (about a millisecond of Python per decode step; the metadata were checked
        when the graph was captured and have the same shapes now). Page indices are already in the
        wrapper's buffer. Returns False (and the public plan() runs) when this FlashInfer does not have the
        internals `_replan_internals` uses."""
        internals = _replan_internals(wrapper)
        if internals is None:
            return False
        self._replan(internals, qo_indptr, kv_indptr, kv_lens)
        return True

    def _replan(self, internals, qo_indptr, kv_indptr, kv_lens) -> None:
        """FlashInfer's MLA planner on the staged host arrays, its schedule copied to the GPU, and the wrapper's
        metadata buffers refreshed (all copies asynchronous, from page-locked memory)."""
        b, plan, staging = internals
        args = (b._float_workspace_buffer, b._int_workspace_buffer, b._pin_memory_int_workspace_buffer,
                qo_indptr, kv_indptr, kv_lens, self.num_heads, self.kv_lora_rank, False)
        if staging:
            _, staged = plan(*args)
            n = int(staged)
            b._int_workspace_buffer.view(torch.uint8)[:n].copy_(
                b._pin_memory_int_workspace_buffer.view(torch.uint8)[:n], non_blocking=True)
        else:
            plan(*args)
        for buf, src in ((b._qo_indptr_buf, qo_indptr), (b._kv_indptr_buf, kv_indptr), (b._kv_len_arr_buf, kv_lens)):
            buf[: src.numel()].copy_(src, non_blocking=True)

    def _graph_wrapper(self, bs: int):
        if bs not in self.graph_wrappers:
            if self.graph_indices is None:  # sized for the largest captured batch at full context
                n = max(self.max_graph_bs, bs) * self.max_context
                self.graph_indices = torch.zeros(n, dtype=torch.int32, device=self.device)
            i32 = dict(dtype=torch.int32, device=self.device)
            self.graph_wrappers[bs] = self._wrapper_cls(
                self.workspace, use_cuda_graph=True, qo_indptr=torch.zeros(bs + 1, **i32),
                kv_indptr=torch.zeros(bs + 1, **i32), kv_indices=self.graph_indices,
                kv_len_arr=torch.zeros(bs, **i32))
        return self.graph_wrappers[bs]

    def _warn_fallback(self, err: Exception) -> None:
        if not self._warned_fallback:
            log.warning("FlashInfer MLA cannot plan this extend batch (%s); such batches use the Triton "
                        "extend kernel", err)
            self._warned_fallback = True

    # ---- attention --------------------------------------------------------------------------
    def _run(self, layer: MLA, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_lat = absorbed_query(layer, q_nope).to(self.q_dtype).contiguous()
        cache = ctx.kv_pool.buffer[layer.layer_id].unsqueeze(1)  # [slots, page_size 1, kv_lora + rope]
        out_lat = self.active.run(query=(q_lat, q_pe.to(self.q_dtype).contiguous()), kv_cache=cache,
                                  **self.kv_scales)
        return latent_to_values(layer, out_lat.to(q_nope.dtype))

    @torch.compiler.disable
    def extend(self, layer: MLA, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, ctx: ForwardContext):
        if self.active is None:
            return self.fallback.extend(layer, q_nope, q_pe, c_kv, k_pe, fb, ctx)
        return self._run(layer, q_nope, q_pe, ctx)

    @torch.compiler.disable
    def decode(self, layer: MLA, q_nope, q_pe, fb: ForwardBatch, ctx: ForwardContext):
        if self.active is None:  # flashinfer-decode at a batch size the tuned table gives the Triton kernel
            return self.fallback.decode(layer, q_nope, q_pe, fb, ctx)
        return self._run(layer, q_nope, q_pe, ctx)
