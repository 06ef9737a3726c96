"""Compile the Triton kernels that some forwards will launch, all at once in parallel, before they run.

A machine's first start compiled every Triton kernel specialisation one at a time when it was first
launched: ~45 s of CUDA-graph capture for 5 DeepSeek-V3 layers on an H100, and seconds of latency on the
first prefill of each new size (docs/perf.md "Start-up"). `record` runs forwards once with Triton's
compile hook (`triton.knobs.runtime.jit_cache_hook`) recording each specialisation that is not compiled
in this process instead of compiling it; Triton then skips that launch, so the pass computes garbage.
That is only safe while NO kernel is compiled in-process (`compiled_kernel`): every launch is skipped
then, whereas a compiled kernel would run for real and may read a skipped kernel's garbage as indices
(the MoE GEMM after a skipped router faults). The recorded specialisations go to a pool of spawned
worker processes (`Compiles`), each compiling one with `JITFunction.preload` (Triton's public entry
point for it) and building the host launcher of its signature (Triton 3.6 compiles one C module per
signature, ~0.3 s each) into Triton's on-disk cache, where the in-process launch later finds both. A
worker that succeeds leaves a marker (keyed by the Triton version, the kernel source's hash and the
specialisation), so a later start sends only what its cache lacks to workers.

The runner records prefill forwards of the token counts that select different kernel configs, then (in
the CUDA-graph runner) records the decode forwards of every graph size and waits for their compiles
(`precompile`) before capturing, and last starts the prefill compiles in the background
(`compile_in_background`: the server is ready meanwhile). Any failure here is logged and ignored: the
kernels then compile in-process on first launch, as before.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import triton
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Specialisation:
    """One kernel specialisation to compile: where its JIT function lives, and Triton's description."""
    module: str
    name: str
    data: str  # Triton's serialised specialisation (the JSON `JITFunction.preload` takes)
    marker: str  # file a successful compile leaves (see the module docstring)


@dataclass
class PrecompileReport:
    kernels: int  # specialisations found uncompiled (in this process) by the recording pass
    missing: int  # of those, not compiled by an earlier start (no marker)
    compiled: int  # of those, compiled by the workers
    record_s: float
    compile_s: float
    workers: int


def default_workers(ranks_on_node: int = 1) -> int:
    """The CPUs this process may use, shared between the ranks of one node."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, ranks_on_node))


def compiled_kernel(packages: tuple[str, ...] = ("kernels",)) -> Optional[str]:
    """The first Triton kernel of `packages` already compiled in this process ("module.name"), or None while
    the process is fresh. The recording pass is only safe in a fresh process (module docstring): a second
    engine in one process, or one built after kernels ran directly (tests, benchmarks), compiles in-process
    as without precompile."""
    for name, module in list(sys.modules.items()):
        if module is None or not any(name == p or name.startswith(p + ".") for p in packages):
            continue
        for obj in list(vars(module).values()):
            while obj is not None and not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
                obj = obj.fn  # autotuner / heuristics wrappers
            if isinstance(obj, JITFunction) and any(caches[0] for caches in obj.device_caches.values()):
                return f"{name}.{obj.fn.__name__}"
    return None


def record(forwards: Iterable[Callable[[], object]]) -> list[Specialisation]:
    """Run each forward with uncompiled Triton kernels recorded instead of compiled (and not launched)."""
    found: dict[Specialisation, None] = {}
    markers = os.path.join(knobs.cache.dir, "dsctl-precompiled")

    def hook(*, fn, compile, **_ignored) -> bool:
        data = compile["specialization_data"]
        key = hashlib.sha256(f"{triton.__version__}\n{fn.jit_function.cache_key}\n{data}".encode()).hexdigest()
        found[Specialisation(fn.module, fn.name, data, os.path.join(markers, key))] = None
        return True  # skip this compile (and so this launch)

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for forward in forwards:
            forward()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(found)


class Compiles:
    """Specialisations being compiled by a pool of spawned worker processes (into Triton's cache), for a
    caller that waits for them (`wait`)."""

    def __init__(self, specs: list[Specialisation], workers: int):
        self.pool = None
        self.futures: dict[cf.Future, Specialisation] = {}
        if specs:
            ctx = multiprocessing.get_context("spawn")
            self.pool = cf.ProcessPoolExecutor(max_workers=min(workers, len(specs)), mp_context=ctx)
            self.futures = {self.pool.submit(compile_one, s.module, s.name, s.data, s.marker): s for s in specs}

    def wait(self) -> int:
        """Block until every compile ended; how many succeeded (failures are logged: the kernel then
        compiles in-process on its first launch, as without precompile)."""
        done = 0
        for fut in cf.as_completed(self.futures):
            try:
                fut.result()
                done += 1
            except Exception as exc:
                log.warning("Triton precompile of %s failed (%s: %s); it compiles at capture instead",
                            self.futures[fut].name, type(exc).__name__, exc)
        if self.pool is not None:
            self.pool.shutdown()  # every compile has ended: the workers exit now
            self.pool = None
        return done


class BackgroundCompiles:
    """Specialisations compiled by daemonic spawned workers while the engine serves (each worker takes
    every n-th one, at a lower scheduling priority); `cancel` stops them at once.

    A compile in progress is abandoned (Triton's cache writes each file whole, by rename, and the marker
    comes last). Not a ProcessPoolExecutor: its workers are not daemonic and are joined at exit, and with
    Python 3.12 a process holding one did not end at all on CPU trials, whether its compiles were still
    running or long finished, shut down (wait=False) or not. The serving engine's ranks outlived their
    shutdown (killed after 30 s on the GPU) also because the workers inherited the rank's ignored SIGTERM,
    so neither `cancel` nor the exit's terminate stopped a compile in progress; the workers restore it.
    tests/engine/test_triton_precompile.py times the exit with these workers, from a rank-like process."""

    def __init__(self, specs: list[Specialisation], workers: int, niceness: int = 10, job=None):
        """job(module, name, data, marker): what compiles one (default `compile_one`; tests pass their own)."""
        ctx = multiprocessing.get_context("spawn")
        self.specs, n = specs, min(workers, len(specs))
        self.workers = [ctx.Process(target=_compile_share, args=(specs[i::n], niceness, job or compile_one),
                                    name=f"triton-precompile-{i}", daemon=True) for i in range(n)]
        for w in self.workers:
            w.start()

    def wait(self) -> int:
        """Block until every worker is done; how many specialisations were compiled (left their marker)."""
        for w in self.workers:
            w.join()
        return sum(os.path.exists(s.marker) for s in self.specs)

    def cancel(self) -> None:
        """Stop every worker now (idempotent); one that outlives SIGTERM by 2 s is killed."""
        for w in self.workers:
            if w.is_alive():
                w.terminate()
        for w in self.workers:
            w.join(2)
            if w.is_alive():
                w.kill()
                w.join()
        self.workers = []


def _compile_share(specs: list[Specialisation], niceness: int, job) -> None:
    """In a background worker: compile `specs` one after the other; a failure leaves that kernel to compile
    in-process on its first launch. An engine rank ignores SIGTERM (the serving process handles it) and a
    spawned child inherits that: restore it, or `cancel` and the exit of the rank wait for every compile."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.nice(niceness)
    for s in specs:
        try:
            job(s.module, s.name, s.data, s.marker)
        except Exception as exc:  # noqa: BLE001 - the serving process compiles it on first use instead
            print(f"Triton background precompile of {s.name} failed ({type(exc).__name__}: {exc}); it compiles "
                  "on first use", file=sys.stderr, flush=True)


def compile_all(specs: list[Specialisation], workers: int) -> int:
    """Compile `specs` in `workers` spawned processes; how many succeeded."""
    return Compiles(specs, workers).wait()


def uncached(specs: list[Specialisation]) -> list[Specialisation]:
    """The specialisations that no earlier precompile left a marker for."""
    return [s for s in specs if not os.path.exists(s.marker)]


def compile_one(module: str, name: str, data: str, marker: str) -> None:
    """In a worker: compile one specialisation of `module.name` (a Triton JIT function, possibly wrapped)
    and its launcher into Triton's cache, then leave `marker`."""
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):  # autotuner / heuristics wrappers hold the JIT function in .fn
        fn = fn.fn
    kernel = fn.preload(data)
    driver.active.launcher_cls(kernel.src, kernel.metadata)  # builds (and caches) the signature's launcher
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w"):
        pass


def precompile(forwards: Iterable[Callable[[], object]], workers: int) -> PrecompileReport:
    """`record` the forwards' uncompiled kernels, then `compile_all` of them (module docstring)."""
    t0 = time.perf_counter()
    specs = record(forwards)
    missing = uncached(specs)
    t1 = time.perf_counter()
    compiled = 0
    try:
        compiled = compile_all(missing, workers)
    except Exception as exc:  # e.g. no processes allowed here: the capture compiles them instead
        log.warning("Triton precompile failed (%s: %s); kernels compile at capture instead", type(exc).__name__, exc)
    report = PrecompileReport(len(specs), len(missing), compiled, t1 - t0, time.perf_counter() - t1, workers)
    log.info("Triton precompile: %d kernels found in %.1f s, %d not in the cache, %d compiled by %d workers in %.1f s",
             report.kernels, report.record_s, report.missing, report.compiled, report.workers, report.compile_s)
    return report


def compile_in_background(specs: list[Specialisation], workers: int) -> BackgroundCompiles:
    """Start compiling the recorded `specs` that the cache lacks without waiting for them (prefill kernels:
    the server is ready meanwhile; a kernel launched before its worker is done compiles in-process, as
    without precompile). `BackgroundCompiles.cancel` stops them."""
    missing = uncached(specs)
    try:
        compiles = BackgroundCompiles(missing, workers)
    except Exception as exc:
        log.warning("Triton precompile failed (%s: %s); kernels compile on first use", type(exc).__name__, exc)
        compiles = BackgroundCompiles([], workers)
    log.info("Triton precompile of prefill kernels: %d found, %d not in the cache, compiling in the background",
             len(specs), len(missing))
    return compiles


class LateCompileLog:
    """After start-up, every Triton specialisation this process compiles (or loads from the disk cache and
    builds a launcher for) stalls the step that launched it. `install` hooks Triton's compile calls and
    logs each one with its time: a warning from `warn_ms`, else at debug level. `count` / `seconds` sum
    them (what a serving benchmark's outlier steps can be checked against). Until `start_serving`, the
    compiles are start-up's warm-up generations' (before the server says ready, no request waits): logged
    at info level as such and counted in `before_ready` only."""

    def __init__(self, warn_ms: float = 100.0):
        self.warn_ms, self.count, self.seconds = warn_ms, 0, 0.0
        self.serving, self.before_ready = False, 0
        self._started: dict[int, float] = {}
        self._site = ""  # the engine code that launched the kernel being compiled

    def install(self) -> None:
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def start_serving(self) -> None:
        """From here on a compile lands on a request's step."""
        self.serving = True

    def _before(self, *, fn, **_ignored) -> bool:
        self._started[id(fn.jit_function)] = time.perf_counter()
        self._site = call_site()
        return False  # compile it as usual

    def _after(self, *, fn, compile=None, **_ignored) -> None:
        started = self._started.pop(id(fn.jit_function), None)
        if started is None:
            return
        ms = (time.perf_counter() - started) * 1e3
        if not self.serving:
            self.before_ready += 1
            log.info("Triton compiled %s before ready, in start-up's warm-up generations: %.0f ms, from %s (%s)",
                     fn.name, ms, self._site, describe_specialisation((compile or {}).get("specialization_data", "")))
            return
        self.count, self.seconds = self.count + 1, self.seconds + ms / 1e3
        level = logging.WARNING if ms >= self.warn_ms else logging.DEBUG
        log.log(level, "Triton compiled %s while serving: %.0f ms in the step that launched it, from %s (%s)",
                fn.name, ms, self._site, describe_specialisation((compile or {}).get("specialization_data", "")))


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # the checkout
_OURS = tuple(_ROOT + d + os.sep for d in ("engine", "kernels"))


def call_site() -> str:
    """The innermost frames of the engine's own code (engine/ and kernels/) on the stack, innermost last:
    where a late compile came from ("engine/model/attention_triton.py:142 _absorbed > kernels/fp8.py:265 ...")."""
    ours = [f for f in traceback.extract_stack() if f.filename.startswith(_OURS) and f.filename != __file__]
    return " > ".join(f"{f.filename[len(_ROOT):]}:{f.lineno} {f.name}" for f in ours[-4:]) or "?"


def describe_specialisation(data: str) -> str:
    """Triton's serialised specialisation (JSON) in one line: the integer / pointer arguments it treats as
    divisible by 16 (what tells two launches of one kernel apart, besides the constexprs), then the
    constexprs. Empty when `data` cannot be read."""
    try:
        spec = json.loads(data)
        names = list(spec["signature"])
        aligned = [names[k[0]] for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])
                   if any(a[0] == "tt.divisibility" for a in v)]
        consts = [f"{names[k[0]]}={v['constexpr'] if isinstance(v, dict) and 'constexpr' in v else v}"
                  for k, v in zip(spec["constant_keys"], spec["constant_vals"])]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return f"divisible by 16: {', '.join(aligned) or '-'}; constants: {', '.join(consts) or '-'}"
