"""Config files as tuning writes them: JSON the engine's look-up reads back, nearest M, resume after a kill."""

import json
from pathlib import Path

import pytest

from engine.errors import UsageError
from kernels import tuned_configs as tc
from tuning import runner
from tuning.runner import BatchResult, TuneOptions, load_done, save
from tuning.shapes import load_model_config, moe_shape
from tuning.targets import MoETarget

DEVICE = "Fake_GPU_X"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(tc.ENV_DIR, raising=False)
    tc.clear_config_cache()
    yield
    tc.clear_config_cache()


@pytest.fixture
def target():
    return MoETarget(moe_shape(load_model_config("deepseek-v3"), tp=8))


def _cfg(bm, bn=64, extra=None):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3,
                **(extra or {}))


def _opts(tmp_path, sizes, resume=False):
    return TuneOptions(batch_sizes=sizes, out_dir=tmp_path, device_name=DEVICE, resume=resume, workers=1)


def test_written_file_is_read_by_engine_lookup(tmp_path, target):
    opts = _opts(tmp_path, [1, 64, 1024])
    out = tmp_path / target.filename(DEVICE)
    results = {1: BatchResult(1, _cfg(16, 32, {"BLOCK_SIZE_N_DOWN": 64})), 64: BatchResult(64, _cfg(32)),
               1024: BatchResult(1024, _cfg(128, 128))}
    save(target, opts, out, results, complete=True)
    assert out.name == "E=256,N=256,device_name=Fake_GPU_X,dtype=fp8_w8a8,block_shape=[128, 128].json"
    raw = json.loads(out.read_text())
    assert list(raw) == ["1", "64", "1024"] and raw["1"]["BLOCK_SIZE_N_DOWN"] == 64
    assert not out.with_name(out.name.replace(".json", ".progress.json")).exists()

    def look(m, **kw):
        return tc.get_moe_config(256, 256, m, 8, "fp8_w8a8", device_name_override=DEVICE, **kw)

    assert look(1, user_dir=tmp_path) == results[1].config
    assert look(40, user_dir=tmp_path) == results[64].config  # nearest tuned M
    assert look(2048, user_dir=tmp_path) == results[1024].config  # 2x the largest tuned M: still the nearest
    assert look(544, user_dir=tmp_path) == results[64].config  # tie |544-64| == |544-1024|: the smaller
    # the directory the engine registers for --kernel-config-dir finds the same file
    tc.set_user_config_dir(tmp_path)
    try:
        assert look(1) == results[1].config
    finally:
        tc.set_user_config_dir(None)


def test_gemm_file_round_trip(tmp_path):
    from tuning.shapes import gemm_shapes
    from tuning.targets import GemmTarget

    t = GemmTarget(gemm_shapes(load_model_config("deepseek-v3"), tp=8, layers=["o_proj"])[0])
    out = tmp_path / t.filename(DEVICE)
    save(t, _opts(tmp_path, [16]), out, {16: BatchResult(16, _cfg(16, 128, {"CUBLAS": 1}))}, complete=True)
    got = tc.get_fp8_gemm_config(7168, 2048, 20, device_name_override=DEVICE, user_dir=tmp_path)
    assert got == _cfg(16, 128, {"CUBLAS": 1})


def test_gemm_extras_time_k_splits_and_a_cublas_winner_keeps_the_triton_split(monkeypatch):
    """The best tiles are timed again with the K loop in 1, 2, 4 and 8 parts (no more parts than K blocks), plus
    cuBLASLt where it runs; a cuBLASLt winner's Triton fallback keeps the split it was timed with."""
    import kernels.fp8 as fp8
    from tuning.shapes import gemm_shapes
    from tuning.targets import GemmTarget

    v3 = load_model_config("deepseek-v3")
    o_proj = GemmTarget(gemm_shapes(v3, tp=8, layers=["o_proj"])[0])  # K = 2048: 16 blocks
    best = dict(_cfg(16, 64), SPLIT_K=3)
    monkeypatch.setattr(fp8, "cublas_block_fp8_supported", lambda *a: False)
    assert [c.get("SPLIT_K") for c in o_proj.extras(best, "cuda")] == [1, 2, 4, 8]
    assert all(c["BLOCK_SIZE_N"] == 64 and "CUBLAS" not in c for c in o_proj.extras(best, "cuda"))
    shared_down = GemmTarget(gemm_shapes(v3, tp=8, layers=["shared_experts.down"])[0])  # K = 256: 2 blocks
    assert [c.get("SPLIT_K") for c in shared_down.extras(_cfg(16, 64), "cuda")] == [1, 2]
    monkeypatch.setattr(fp8, "cublas_block_fp8_supported", lambda *a: True)
    assert o_proj.extras(best, "cuda")[-1] == dict(_cfg(16, 64), CUBLAS=1)
    ranked = [dict(_cfg(16, 64), CUBLAS=1), dict(_cfg(16, 32), SPLIT_K=4)]
    assert o_proj.finalize(ranked[0], ranked) == dict(_cfg(16, 32), SPLIT_K=4, CUBLAS=1)


def test_moe_extras_time_gate_up_splits_and_w4afp8_activation_sums():
    """The fused MoE's best config is timed again with gate_up's K loop in 1, 2, 4, 8 parts (down unsplit); the
    W4AFP8 kernel has no split: its swapped GEMMs are timed again summing the activations' groups themselves
    instead of reading the quantiser's sums (ACT_SUMS 0), each alone and both; a config whose GEMMs are both
    row-major gets none."""
    v3 = load_model_config("deepseek-v3")
    fp8 = MoETarget(moe_shape(v3, tp=8))
    got = fp8.extras(_cfg(16), "cuda")
    assert [c["SPLIT_K"] for c in got] == [1, 2, 4, 8] and all(c["SPLIT_K_DOWN"] == 1 for c in got)
    w4 = MoETarget(moe_shape(v3, tp=8, dtype="w4afp8"))
    swapped = dict(_cfg(16, 64), BLOCK_SIZE_K=256, BLOCK_SIZE_N_DOWN=128)
    sums = [{k: c[k] for k in ("ACT_SUMS", "ACT_SUMS_DOWN") if k in c} for c in w4.extras(swapped, "cuda")]
    assert sums == [dict(ACT_SUMS=0), dict(ACT_SUMS_DOWN=0), dict(ACT_SUMS=0, ACT_SUMS_DOWN=0)]
    assert all({k: v for k, v in c.items() if not k.startswith("ACT_SUMS")} == swapped
               for c in w4.extras(swapped, "cuda"))  # nothing else changed
    row_major = dict(_cfg(16, 32), BLOCK_SIZE_N_DOWN=32)  # 32 weight rows: the row-major kernel, no sums
    assert w4.extras(row_major, "cuda") == []
    assert [c.get("ACT_SUMS_DOWN") for c in w4.extras(dict(row_major, BLOCK_SIZE_N_DOWN=128), "cuda")] == [0]


def test_resume_after_kill(tmp_path, target, monkeypatch):
    """A run killed after M=1 and M=2: --resume tunes only the rest and the file ends complete."""
    out = tmp_path / target.filename(DEVICE)
    partial = {1: BatchResult(1, _cfg(16), tuned_us=10.0, default_us=12.0),
               2: BatchResult(2, _cfg(16, 128), tuned_us=11.0, default_us=12.5)}
    save(target, _opts(tmp_path, [1, 2, 4, 8]), out, partial, complete=False)  # what the killed run left
    progress = out.with_name(out.name.replace(".json", ".progress.json"))
    assert progress.is_file() and set(tc.load_configs(out)) == {1, 2}

    tuned = []

    def fake_tune_batch(self, m, existing):
        tuned.append(m)
        return BatchResult(m, _cfg(32 if m > 2 else 16), tuned_us=20.0 + m, default_us=30.0)

    monkeypatch.setattr(runner.Searcher, "tune_batch", fake_tune_batch)
    monkeypatch.setattr(runner, "make_precompiler", lambda opts, device: None)
    report = runner.tune(target, _opts(tmp_path, [1, 2, 4, 8], resume=True), device="cpu")
    assert tuned == [4, 8]
    assert report.results[1].tuned_us == 10.0  # kept from the progress file, timings included
    assert set(tc.load_configs(out)) == {1, 2, 4, 8}
    assert tc.load_configs(out)[8]["BLOCK_SIZE_M"] == 32
    assert not progress.exists()  # complete: the progress file is gone

    # without --resume everything is tuned again
    tuned.clear()
    runner.tune(target, _opts(tmp_path, [1, 2]), device="cpu")
    assert tuned == [1, 2]


def test_resume_from_config_file_only(tmp_path, target):
    out = tmp_path / target.filename(DEVICE)
    tc.save_configs(out, {1: _cfg(16), 8: _cfg(16)})
    done = load_done(target, _opts(tmp_path, [1, 8, 64], resume=True), out)
    assert set(done) == {1, 8} and done[8].config == _cfg(16)
    assert load_done(target, _opts(tmp_path, [1, 8], resume=False), out) == {}


def test_resume_refuses_other_shape(tmp_path, target):
    out = tmp_path / target.filename(DEVICE)
    save(target, _opts(tmp_path, [1, 2]), out, {1: BatchResult(1, _cfg(16))}, complete=False)
    other = MoETarget(moe_shape(load_model_config("deepseek-v3"), tp=8, ep=8))
    with pytest.raises(UsageError, match="another shape"):
        load_done(other, _opts(tmp_path, [1, 2], resume=True), out)


def test_results_json(tmp_path, target, monkeypatch):
    monkeypatch.setattr(runner.Searcher, "tune_batch",
                        lambda self, m, existing: BatchResult(m, _cfg(16), tuned_us=10.0, default_us=15.0))
    monkeypatch.setattr(runner, "make_precompiler", lambda opts, device: None)
    opts = _opts(tmp_path / "configs", [1, 4])
    opts.report_dir = tmp_path / "results"
    runner.tune(target, opts, device="cpu")
    data = json.loads(next(Path(opts.report_dir).glob("*.results.json")).read_text())
    assert [r["m"] for r in data["results"]] == [1, 4]
    assert data["results"][0]["speedup"] == pytest.approx(1.5)
