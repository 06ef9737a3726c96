"""Compile candidate kernels in parallel worker processes before they are timed.

Triton compiles a kernel the first time a config is launched; at DeepSeek shapes that takes
0.5-15 s per config and would dominate a tuning run done in one process. Workers (spawned
processes on the same GPU) each launch their share of the configs once on a tiny problem with
the same N, K, top-k and dtype: Triton specialises a kernel on constexprs and on which integer
arguments are divisible by 16, not on the number of tokens or experts, so the compiled binaries
land in Triton's on-disk cache under the keys the timing process then looks up. For the GEMM the
scale stride equals M, so each batch-size class (M = 1, M % 16 == 0, other) is compiled apart.

A config that fails in a worker (out of shared memory, compile error) is reported and skipped.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from dataclasses import replace
from typing import Callable, Iterable, Optional

import torch

from tuning.bench import GemmProblem, MoEProblem
from tuning.search_space import config_key

_PROBLEMS: dict = {}  # worker side: tiny problems by shape


def m_class(m: int) -> int:
    """A representative batch size with the same integer specialisation as m."""
    if m == 1:
        return 1
    return 16 if m % 16 == 0 else 8


def _tiny_problem(kind: str, shape, device_index: int):
    key = (kind, shape)
    if key not in _PROBLEMS:
        torch.cuda.set_device(device_index)
        if kind == "moe":
            # 2 experts are enough: E is no kernel argument of the GEMMs; ids are drawn from them
            small = replace(shape, E=2, ep=1, routing=replace(shape.routing, n_experts=max(2, shape.top_k)))
            prob = MoEProblem(small, "cuda")
        else:
            prob = GemmProblem(shape, "cuda", copies=1)
        _PROBLEMS[key] = prob
    return _PROBLEMS[key]


def _compile_one(kind: str, shape, device_index: int, m: int, cfg: dict) -> Optional[str]:
    """Worker: launch cfg once; None on success, else a one-line error."""
    try:
        prob = _tiny_problem(kind, shape, device_index)
        if kind == "moe":
            x = torch.randn(4, shape.K, device="cuda").to(torch.bfloat16)
            ids = torch.arange(4 * shape.top_k, device="cuda", dtype=torch.int32).view(4, shape.top_k) % 2
            inp = (x, ids, torch.rand(4, shape.top_k, device="cuda"))
        else:
            inp = prob.inputs(m, 1)[0]
        prob.run(cfg, inp)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - reported back, the config is skipped
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        return f"{type(exc).__name__}: {text}"


class Precompiler:
    """A pool of spawned compile workers; `compile()` blocks until the given configs are built."""

    def __init__(self, workers: int, device_index: int = 0):
        self.workers = workers
        self.device_index = device_index
        self.done: dict[tuple, Optional[str]] = {}
        self.kernels_built = 0
        self.seconds = 0.0
        self.broken: Optional[str] = None  # set when a worker died
        ctx = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)

    def compile(self, kind: str, shape, jobs: Iterable[tuple[int, dict]],
                on_done: Optional[Callable[[int, int], None]] = None) -> dict[tuple, str]:
        """jobs: (batch size, config). Returns {config_key: error} of configs that failed."""
        t0 = time.perf_counter()
        todo = {}
        for m, cfg in jobs:
            key = (kind, shape, m_class(m) if kind == "gemm" else 0, config_key(cfg))
            if key not in self.done and key not in todo:
                todo[key] = cfg
        futures = {self.pool.submit(_compile_one, kind, shape, self.device_index, key[2] or 4, cfg): key
                   for key, cfg in todo.items()}
        for i, fut in enumerate(cf.as_completed(futures)):
            key = futures[fut]
            try:
                self.done[key] = fut.result()
            except Exception as exc:  # noqa: BLE001 - a dead worker: leave the config to the timing process
                self.done[key] = None
                self.broken = f"{type(exc).__name__}: {exc}"
            if on_done:
                on_done(i + 1, len(futures))
        self.kernels_built += len(todo)
        self.seconds += time.perf_counter() - t0
        return {key[3]: err for key, err in self.done.items()
                if err is not None and key[0] == kind and key[1] == shape}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 2)))
