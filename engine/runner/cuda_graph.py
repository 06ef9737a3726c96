"""CUDA graphs for decode: capture one graph per batch size, replay with padded inputs.

All graphs read their inputs from one set of static buffers sized for the largest
captured batch and share one memory pool (captured largest first). The model runner captures the
model's decode forward, and with speculative decoding a second CudaGraphRunner captures the MTP
layer's (engine/speculative/draft_runner.py; its hidden-state input is one more static buffer); both
serve tree forwards, whose rows point at the request table's scratch rows (engine/memory/pools.py).
A decode batch of size b is padded to the smallest captured size >= b: padding rows point at the
request table's padding row (every slot 0, the KV pool's scratch slot) with
sequence length 1, so they attend to one scratch token and write only scratch.
With --enable-torch-compile the model's decode forward is compiled before capture
for batch sizes up to --torch-compile-max-bs.
With compile_workers > 0 (the runner passes --triton-compile-workers in a fresh process) the Triton
kernels of every size are first compiled in parallel worker processes (engine/runner/triton_precompile.py).

`prepare(fb, bs)` (the runner's: DP attention's gather, then `ForwardContext.begin_forward`) runs the
backends' host-side planning outside the graph: before each capture (on the dummy
batch) and before each replay (on the padded batch, whose host lengths it reads);
backends whose kernels read lengths from device tensors do nothing there.

Under DP attention (engine/distributed/dp_sync.py) the groups agree on one padded size for every
DP group (`replay(fb, bs)`), and a group with no work replays that size on padding rows alone
(`replay_padding`). `capture=False` keeps the static buffers and the padding but runs the forward
eagerly at replay: the CPU tests drive the padded paths (DP attention's included) through it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import time
from typing import Callable, ContextManager, Optional

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.runner.triton_precompile import precompile

log = logging.getLogger(__name__)

WARM_UPS_FIRST = 2  # eager forwards before the first (largest) size's capture
WARM_UPS = 1  # before each later size's


class CudaGraphRunner:
    def __init__(self, forward: Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor]], batch_sizes: list[int],
                 padding_row: int, device: torch.device, compiled_forward=None, compile_max_bs: int = 0,
                 prepare: Callable[[ForwardBatch, int], None] = lambda fb, bs: None, capture: bool = True,
                 spec_hidden: Optional[tuple[int, torch.dtype]] = None, compile_workers: int = 0,
                 record_scope: Callable[[], ContextManager] = contextlib.nullcontext):
        """spec_hidden: (width, dtype) of the MTP layer's hidden-state input, for graphs of its forward;
        compile_workers: processes that compile the Triton kernels of every size before capture (0: none);
        record_scope: entered around the precompile's recording forwards (the model's `representative_layers`:
        the kernels are the same at any depth, and the pass then takes two layers' time)."""
        self.sizes = sorted(batch_sizes)
        self.forward = forward
        self.max_bs = self.sizes[-1]
        self.padding_row = padding_row
        self.prepare = prepare
        self.device = device
        self.record_scope = record_scope
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.full((n,), padding_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.spec_hidden = None if spec_hidden is None else torch.zeros(n, spec_hidden[0], dtype=spec_hidden[1],
                                                                        device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}  # the static batch each graph was captured with
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds: dict[int, float] = {}  # per size: warm-up forwards + capture (start-up profile)
        self.precompiled = None  # engine.runner.triton_precompile.PrecompileReport when compile_workers > 0
        if not capture:  # padded static batches, run eagerly at replay (CPU tests of the padded paths)
            self.batches = {bs: self._batch(bs) for bs in self.sizes}
            return
        if compile_workers:
            self.precompiled = self._precompile(compile_workers)
        self._capture_all(compiled_forward, compile_max_bs)

    def _capture_all(self, compiled_forward, compile_max_bs: int) -> None:
        """One graph per size, largest first, all in one memory pool. The first size runs two warm-up forwards
        (lazy initialisation, kernels loaded, allocator blocks); each later size one (its own Triton
        specialisations and tuned configs loaded before capture), or two where torch.compile'd (a new size
        compiles). Logs where the time went."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        split = {"warm-up": 0.0, "record": 0.0, "instantiate": 0.0}
        for i, bs in enumerate(reversed(self.sizes)):
            t0 = time.perf_counter()
            fn = compiled_forward if compiled_forward is not None and bs <= compile_max_bs else self.forward
            fb = self.batches[bs] = self._batch(bs)
            self.prepare(fb, bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARM_UPS_FIRST if i == 0 or fn is compiled_forward else WARM_UPS):
                    fn(fb)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool)
                try:
                    self.outputs[bs] = fn(fb)
                    t2 = time.perf_counter()
                finally:
                    graph.capture_end()
            self.graphs[bs] = graph
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            t3 = time.perf_counter()
            self.capture_seconds[bs] = t3 - t0
            for name, secs in zip(split, (t1 - t0, t2 - t1, t3 - t2)):
                split[name] += secs
        log.info("CUDA graphs: %d decode sizes (%d-%d) in %.1f s: %s", len(self.sizes), self.sizes[0], self.max_bs,
                 sum(self.capture_seconds.values()), ", ".join(f"{k} {v:.1f} s" for k, v in split.items()))
        log.debug("CUDA graph capture seconds per batch size: %s",
                  {bs: round(t, 2) for bs, t in sorted(self.capture_seconds.items())})

    def release(self) -> None:
        """Free the captured graphs now, not at garbage collection. A graph that captured NCCL collectives
        holds their communicator: `destroy_process_group` then waits on it forever (pytorch/pytorch#115388),
        so the ranks release their graphs before they leave the process group."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def _precompile(self, workers: int):
        """Compile, in parallel, the Triton kernels that the eager forward launches at every size
        (engine/runner/triton_precompile.py); the capture below then loads them from Triton's cache."""
        def run(bs: int) -> None:
            fb = self._batch(bs)
            self.prepare(fb, bs)
            self.forward(fb)

        with self.record_scope():
            report = precompile([functools.partial(run, bs) for bs in reversed(self.sizes)], workers)
        torch.cuda.synchronize()
        return report

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], extend_lens=torch.ones_like(self.seq_lens[:bs]),
            prefix_lens=self.seq_lens[:bs] - 1, logits_indices=self.logits_indices[:bs],
            seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            spec_hidden=None if self.spec_hidden is None else self.spec_hidden[:bs],
        )

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode is ForwardMode.DECODE and 0 < fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch, bs: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run decode batch fb through the graph of size `bs` (default: the smallest captured size that
        holds it); rows past fb's are padding."""
        b = fb.batch_size
        bs = bs or self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.req_pool_indices[:b].copy_(fb.req_pool_indices)
        self.seq_lens[:b].copy_(fb.seq_lens)
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        if self.spec_hidden is not None:
            self.spec_hidden[:b].copy_(fb.spec_hidden)
        logits, hidden = self._run_padded(b, bs, list(fb.seq_lens_cpu), fb.req_rows_cpu)
        return logits[:b], hidden[:b]

    def replay_padding(self, bs: int) -> None:
        """Replay the graph of size bs on padding rows only (a DP-attention group with no work of its own
        while the other groups replay this size: it still joins the graph's collectives)."""
        self._run_padded(0, bs, [], [])

    def _run_padded(self, b: int, bs: int, lens: list[int],
                    rows: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.req_pool_indices[b:bs].fill_(self.padding_row)
            self.seq_lens[b:bs].fill_(1)
            self.out_cache_loc[b:bs].zero_()
            if self.spec_hidden is not None:
                self.spec_hidden[b:bs].zero_()
        lens = lens + [1] * (bs - b)  # host copies of what the static buffers now hold (rows: when known)
        rows = None if rows is None else list(rows) + [self.padding_row] * (bs - b)
        batch = dataclasses.replace(self.batches[bs], seq_lens_cpu=lens, prefix_lens_cpu=[n - 1 for n in lens],
                                    req_rows_cpu=rows, real_tokens=b)
        self.prepare(batch, bs)
        if bs not in self.graphs:  # built with capture=False
            return self.forward(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]
