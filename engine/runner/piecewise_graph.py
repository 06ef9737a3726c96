"""Piecewise CUDA graphs for extend (prefill and mixed) steps: every layer's work but attention, replayed.

An eager extend step launches every kernel of every layer from Python: at depth that is thousands of
launches, tens of ms of host time per step whatever its token count (docs/perf.md "Mixed batches"), which
makes small prefill chunks and mixed prefill + decode steps expensive. Attention is the one part whose
work depends on each request's lengths (and is planned on the host); the rest (projections, norms, rope,
the KV-cache write, the MoE, the collectives) only depends on the token count.

So for each token bucket the forward is captured as a chain of graphs cut at every MLA layer's attention:
segment 0 runs the embedding and layer 0 up to its attention, segment i+1 runs layer i after its attention
(o_proj, all-reduce, residual, MLP / MoE) and layer i+1 up to its attention, the last segment ends with the
final hidden states. At the cut, the captured segment copies the layer's attention inputs (q_nope, q_pe,
c_kv, k_pe) into static buffers shared by every layer and bucket; at replay the real attention backend runs
eagerly on the batch's own T tokens (its usual host planning, once per step) and writes into a static
output buffer, which the next segment reads. The logits are computed eagerly from the hidden states.

A batch of T tokens replays the smallest bucket >= T (under DP attention: the bucket the groups agreed on,
engine/distributed/dp_attention.py `agree`): rows past T are padding (token 0, position 0, KV slot 0,
the pool's scratch slot); their attention output is whatever finite values an earlier step left in the
static output (zero at first), and nothing reads their results. Every graph of every bucket shares one
memory pool (captured largest bucket first): a chain replays whole before another starts, and what
crosses a cut lives in this runner's static buffers.

Decode batches that no decode graph holds (larger than the largest captured size, or under DP attention
while another group extends) replay the same chains: only attention depends on the batch's mode, and it
runs outside them.

Under DP attention every group replays the chain of the same bucket, each with its own T tokens (an idle
group none: `replay_idle`), and the gather before each MLP is captured at that bucket's width for every
group (`prepare`: the runner's uniform gather), so its all-gather is recorded in the pieces. Not used with
--disable-mla (its attention writes the cache itself) or two-batch overlap (its micro-batches run eagerly);
those extend steps run eagerly as before. With --enable-torch-compile the pieces capture the uncompiled layers
(torch.compile serves the decode graphs). `capture=False` runs the same padded batches and static buffers
eagerly, attention through the same cut (CPU tests).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model.context import ForwardContext

log = logging.getLogger(__name__)

# token buckets: a step pads to the next one (the scheduler sizes capped steps to fill one exactly)
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 4608, 5120,
           5632, 6144, 6656, 7168, 7680, 8192)


def bucket_sizes(max_tokens: int) -> list[int]:
    """The token buckets captured for steps of at most `max_tokens` tokens (that count itself included)."""
    sizes = [b for b in BUCKETS if b < max_tokens]
    return sizes + [max_tokens] if max_tokens > 0 else []


class _Cut:
    """Stands in for the attention backend while the model runs through the chain: at each MLA layer's
    attention it copies the inputs into the static buffers, then (capturing) ends the current graph and
    begins the next, or (eager, capture=False) runs the real attention on the batch's T tokens."""

    def __init__(self, runner: PiecewiseGraphs):
        self.runner = runner

    def begin_forward(self, fb: ForwardBatch, ctx: ForwardContext, graph_bs: int | None = None) -> None:
        pass  # the real backend plans at replay, on the real batch

    def decode(self, layer, q_nope, q_pe, fb, ctx):
        raise AssertionError("piecewise graphs run extend batches only")

    def extend(self, layer, q_nope, q_pe, c_kv, k_pe, fb: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        return self.runner.cut(layer, q_nope, q_pe, c_kv, k_pe)


class PiecewiseGraphs:
    def __init__(self, model, ctx: ForwardContext, sizes: list[int], padding_row: int, device: torch.device,
                 capture: bool = True, prepare: Optional[Callable[[int], None]] = None, groups: int = 1):
        """model: a DeepseekForCausalLM; ctx: its forward context (its attention backend is the real one);
        sizes: token buckets; padding_row: the request table's padding row (its slots are the scratch slot);
        prepare: called with each bucket before its capture (DP attention: the gather at that width); groups:
        the DP groups whose rows the MoE sees (1 without DP attention)."""
        self.model, self.ctx, self.sizes, self.device = model, ctx, tuple(sorted(sizes)), device
        self.prepare = prepare
        self.groups = groups  # blocks of the MoE's padded input
        self.padding_row = padding_row
        n = self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.attn_in: Optional[tuple[torch.Tensor, ...]] = None  # q_nope, q_pe, c_kv, k_pe (made at first cut)
        self.attn_out: Optional[torch.Tensor] = None  # [n, H, v]: the attention output every next segment reads
        self.layers: list = []  # the MLA layers in the order the chain cuts at them
        self.chains: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # per bucket: the chain's final hidden states
        self.capture_seconds = 0.0
        self._fb: Optional[ForwardBatch] = None  # the real batch being replayed
        self._backend = ctx.attn_backend  # the real attention backend (the cut stands in for it in the forward)
        self._tokens = 0
        self._capturing: Optional[list[torch.cuda.CUDAGraph]] = None
        self._pool = self._stream = None
        if capture:
            self._capture_all()

    # ---- the cut ---------------------------------------------------------------------------------
    def cut(self, layer, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        n = q_nope.shape[0]
        if self.attn_in is None:
            self._make_buffers(layer, q_nope, q_pe, c_kv, k_pe)
        for buf, x in zip(self.attn_in, (q_nope, q_pe, c_kv, k_pe)):
            buf[:n].copy_(x)
        if self._capturing is not None:
            if not self.chains:  # the first bucket's capture lists the layers (every chain cuts alike)
                self.layers.append(layer)
            self._capturing[-1].capture_end()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool)
            self._capturing.append(graph)
        elif self._fb is not None:  # eager (capture=False): the real attention, as a replay runs it
            self._attend(layer)
        return self.attn_out[:n]

    def _make_buffers(self, layer, q_nope, q_pe, c_kv, k_pe) -> None:
        """The static buffers at the bucket maximum (allocated outside any graph pool)."""
        n = self.max_tokens
        self.attn_in = tuple(torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
                             for x in (q_nope, q_pe, c_kv, k_pe))
        self.attn_out = torch.zeros(n, layer.num_heads, layer.v_dim, dtype=q_nope.dtype, device=q_nope.device)

    def _attend(self, layer) -> None:
        t = self._tokens
        if not t:
            return  # an idle group's replay: no attention of its own
        q_nope, q_pe, c_kv, k_pe = (buf[:t] for buf in self.attn_in)
        if self._fb.mode.is_decode:
            out = self._backend.decode(layer, q_nope, q_pe, self._fb, self.ctx)
        else:
            out = self._backend.extend(layer, q_nope, q_pe, c_kv, k_pe, self._fb, self.ctx)
        self.attn_out[:t].copy_(out)

    # ---- capture ---------------------------------------------------------------------------------
    def _static_batch(self, n: int) -> ForwardBatch:
        """A batch of n tokens over the static buffers (one request in the padding row; attention never
        sees it)."""
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, [self.padding_row], [0], [n],
                                torch.zeros(n, dtype=torch.int64), [n - 1], self.device)
        return dataclasses.replace(fb, input_ids=self.input_ids[:n], positions=self.positions[:n],
                                   out_cache_loc=self.out_cache_loc[:n])

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        self.ctx.attn_backend = _Cut(self)
        try:
            self.ctx.static_shapes = True  # the layers keep fixed shapes and make no host synchronisation
            return self.model.hidden_states(fb, self.ctx)
        finally:
            self.ctx.attn_backend = self._backend

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(self.device)
        warm_up = 0.0
        for n in reversed(self.sizes):
            fb = self._static_batch(n)
            if self.prepare is not None:
                self.prepare(n)
            self.ctx.mask_padding([n] * self.groups, n)  # no padding at capture: the router's read of them is captured
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                t1 = time.perf_counter()
                self._run_model(fb)  # warm-up: lazy initialisation, kernels loaded before capture
                torch.cuda.synchronize(self.device)
                warm_up += time.perf_counter() - t1
                first = torch.cuda.CUDAGraph()
                self._capturing = [first]
                first.capture_begin(pool=self._pool)
                try:
                    hidden = self._run_model(fb)
                finally:
                    self._capturing[-1].capture_end()
                self.hidden[n] = hidden
                self.chains[n] = self._capturing
                self._capturing = None
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            torch.cuda.synchronize(self.device)
        self.ctx.pad_rows = None
        self.capture_seconds = time.perf_counter() - t0
        log.info("piecewise CUDA graphs: %d token buckets up to %d, %d layers each, captured in %.1f s (warm-up "
                 "forwards %.1f s)", len(self.sizes), self.max_tokens, len(self.layers), self.capture_seconds, warm_up)

    def release(self) -> None:
        for chain in self.chains.values():
            for graph in chain:
                graph.reset()
        self.chains.clear()
        self.hidden.clear()

    # ---- replay ----------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode in (ForwardMode.EXTEND, ForwardMode.DECODE) and 0 < fb.num_tokens <= self.max_tokens
                and fb.spec_hidden is None)

    def bucket(self, tokens: int) -> int:
        """The smallest bucket that holds `tokens` tokens."""
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def replay(self, fb: ForwardBatch, n: Optional[int] = None,
               real: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits at fb.logits_indices, hidden states [T, hidden]) of extend or decode batch fb, through the
        chain of bucket n (default: the smallest that holds it); real: every DP group's own tokens (DP attention;
        default: fb's alone), whose padding rows the MoE layers skip."""
        t = fb.num_tokens
        n = n or self.bucket(t)
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:t].copy_(src)
            if n > t:
                buf[t:n].zero_()
        self.ctx.begin_forward(fb)  # the real backend's planning for the real batch
        self.ctx.mask_padding(real or [t], n)
        hidden = self._run_chain(fb, n)[:t].clone()  # the static copy is the next replay's
        return self.model.logits(hidden[fb.logits_indices]), hidden

    def replay_idle(self, n: int, idle: ForwardBatch, real: Sequence[int]) -> None:
        """The chain of bucket n on padding rows only (idle: a batch of no tokens; real: every DP group's own
        tokens): a DP-attention group with no work of its own joins the collectives the other groups' replays of n
        run."""
        for buf in (self.input_ids, self.positions, self.out_cache_loc):
            buf[:n].zero_()
        self.ctx.begin_forward(idle)  # no attention planning; no routing counted
        self.ctx.mask_padding(real, n)
        self._run_chain(idle, n)

    def _run_chain(self, fb: ForwardBatch, n: int) -> torch.Tensor:
        """Every piece of bucket n, the real attention of fb's tokens between them; the final hidden states [n]."""
        self._fb, self._tokens = fb, fb.num_tokens
        try:
            if n in self.chains:
                chain = self.chains[n]
                for graph, layer in zip(chain, self.layers):
                    graph.replay()
                    self._attend(layer)
                chain[-1].replay()
                return self.hidden[n]
            return self._run_model(self._static_batch(n))  # capture=False: the same cut, run eagerly
        finally:
            self._fb = None
            self.ctx.static_shapes = False
            self.ctx.pad_rows = None
