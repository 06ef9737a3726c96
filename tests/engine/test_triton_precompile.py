"""CPU side of the parallel Triton precompile (engine/runner/triton_precompile.py; the GPU test is
tests/gpu/test_triton_precompile.py): flag checks, the worker share, that a failing compile is
logged and left to the capture instead of stopping start-up, and that background compiles never hold
a process at exit."""

import logging
import multiprocessing

import pytest

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.runner.triton_precompile import (
    BackgroundCompiles,
    LateCompileLog,
    Specialisation,
    compile_all,
    default_workers,
)


def test_flag_rejects_negative_workers():
    with pytest.raises(UsageError, match="--triton-compile-workers"):
        EngineArgs.of(model="tiny", triton_compile_workers=-1).validate()
    EngineArgs.of(model="tiny", triton_compile_workers=0).validate()


def test_workers_are_shared_between_ranks_of_a_node():
    alone = default_workers(1)
    assert alone >= 1
    assert default_workers(8) == max(1, alone // 8)


def test_failed_compile_is_logged_not_raised(caplog):
    spec = Specialisation("engine.no_such_module", "kernel", "{}", "/nonexistent/marker")
    with caplog.at_level(logging.WARNING, logger="engine.runner.triton_precompile"):
        assert compile_all([spec], workers=1) == 0
    assert "compiles at capture instead" in caplog.text
    assert compile_all([], workers=4) == 0


def test_background_compiles_run_every_specialisation(tmp_path):
    from tests.engine.precompile_jobs import leave_marker

    specs = [Specialisation("m", f"k{i}", "{}", str(tmp_path / f"k{i}")) for i in range(5)]
    bg = BackgroundCompiles(specs, workers=2, niceness=0, job=leave_marker)
    assert bg.wait() == 5 and all((tmp_path / f"k{i}").exists() for i in range(5))
    bg.cancel()
    assert BackgroundCompiles([], workers=4).wait() == 0


@pytest.mark.parametrize("compiling", [True, False], ids=["mid-compile", "compiles-done"])
@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "not-cancelled"])
def test_a_process_with_background_compiles_exits_at_once(tmp_path, compiling, cancel):
    """An engine rank that ends with background compiles running, or done, must end at once (a process
    holding a ProcessPoolExecutor did not end at all in either case: the GPU server's ranks outlived their
    shutdown)."""
    from tests.engine.precompile_jobs import end_with_background_compiles

    proc = multiprocessing.get_context("spawn").Process(target=end_with_background_compiles,
                                                        args=(str(tmp_path), compiling, cancel))
    proc.start()
    proc.join(60)  # start-up (spawn + imports) takes seconds; the compiling jobs last 600 s
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive, "the process waited for its background compiles at exit"
    assert proc.exitcode == 0


def test_late_compiles_are_logged_with_their_time(caplog, monkeypatch):
    """The installed hooks, called as Triton calls them around an in-process compile: the compile goes ahead
    (the cache hook returns False); before `start_serving` (start-up's warm-up generations) a compile is an
    info line and not counted; after it a slow one is a warning naming the kernel, a fast one only debug."""
    from types import SimpleNamespace

    import triton.language as tl
    from triton import knobs
    from triton.runtime.jit import serialize_specialization_data

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    clock = iter([1.0, 1.5, 10.0, 10.25, 20.0, 20.01])
    monkeypatch.setattr("engine.runner.triton_precompile.time.perf_counter", lambda: next(clock))
    late = LateCompileLog(warn_ms=100)
    late.install()
    slow, fast = (SimpleNamespace(name=n, jit_function=object()) for n in ("_extend_fwd", "_rms_norm"))
    data = serialize_specialization_data("_extend_fwd", {"q_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                                         {(2,): tl.constexpr(64)}, {(0,): [["tt.divisibility", 16]]},
                                         SimpleNamespace(num_warps=8), "key", SimpleNamespace(backend="cuda"))
    def compile_one(fn, compile):
        assert knobs.runtime.jit_cache_hook(key=0, repr="r", fn=fn, compile=compile, is_manual_warmup=False,
                                            already_compiled=False) is False
        knobs.runtime.jit_post_compile_hook(key=0, repr="r", fn=fn, compile=compile, is_manual_warmup=False,
                                            already_compiled=False)

    with caplog.at_level(logging.DEBUG, logger="engine.runner.triton_precompile"):
        # start-up's warm-up generations: before ready, an info line, not counted as late
        compile_one(SimpleNamespace(name="_mla_rope_cache_kernel", jit_function=object()), {})
        early = [r for r in caplog.records if "_mla_rope_cache_kernel" in r.getMessage()]
        assert [r.levelno for r in early] == [logging.INFO] and "before ready" in early[0].getMessage()
        assert "500 ms" in early[0].getMessage() and late.before_ready == 1 and late.count == 0
        late.start_serving()
        for fn in (slow, fast):
            compile_one(fn, {"specialization_data": data})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_extend_fwd" in warnings[0] and "250 ms" in warnings[0]
    assert "divisible by 16: q_ptr; constants: BLOCK=64" in warnings[0]  # what tells this specialisation apart
    assert "from ?" in warnings[0]  # no engine frame launched it here (the call site otherwise)
    assert any(r.levelno == logging.DEBUG and "_rms_norm" in r.getMessage() for r in caplog.records)
    assert late.count == 2 and abs(late.seconds - 0.26) < 1e-9


def test_representative_layers_run_one_layer_of_each_kind():
    """The recording pass of the prefill kernels runs the first dense and the first MoE layer only (the same
    kernels as every layer, two layers' time at any depth): inside, a forward runs and equals one of a model
    cut to those layers; after, every layer is back."""
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(model="tiny", device="cpu", dtype="float32")
    model = eng.runner.model
    every = list(model.layers)
    assert [layer.is_moe for layer in every] == [False, True, True, True]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with model.representative_layers():
        assert list(model.layers) == every[:2]
        cut = eng.generate(input_ids=[[5, 6, 7, 8, 9]], sampling_params=params)[0].token_ids
    assert list(model.layers) == every
    short = Engine(model="tiny", device="cpu", dtype="float32", num_layers=2)
    assert short.generate(input_ids=[[5, 6, 7, 8, 9]], sampling_params=params)[0].token_ids == cut
