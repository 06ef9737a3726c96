"""`dsctl tune-mla` (tuning/mla_decode.py, dsctl/cmd_tune_mla.py) and the table it writes: the decode problem of a
layout, the candidates, the search's picks (a scripted timer: CPU timings mean nothing), the file the engine looks
up, resuming, and the command line. The candidates' outputs are checked in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from dsctl.cli import app
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.errors import UsageError
from kernels import tuned_configs as tc
from kernels.mla_decode import DecodeConfig, config_from_ints, config_to_ints, default_config
from tuning import mla_decode as tm

V3 = parse_config(lookup("deepseek-v3").config_dict())


def test_heads_per_rank_follow_the_layout():
    assert tm.mla_shape(V3, tp=8, dp=1, kv_cache_dtype="bf16").heads == 16
    assert tm.mla_shape(V3, tp=8, dp=8, kv_cache_dtype="fp8_e4m3").heads == 128  # DP attention: all heads
    assert tm.mla_shape(V3, tp=4, dp=2, kv_cache_dtype="bf16").heads == 64
    with pytest.raises(UsageError, match="--dp 3 must divide --tp 8"):
        tm.mla_shape(V3, tp=8, dp=3, kv_cache_dtype="bf16")
    with pytest.raises(UsageError, match="--kv-cache-dtype 'int8'"):
        tm.mla_shape(V3, tp=8, dp=1, kv_cache_dtype="int8")
    assert tm.mla_shape(V3, 8, 1, "fp8_e4m3").filename("NVIDIA H200") == \
        "MLA_DECODE,H=16,kv_dtype=fp8_e4m3,device_name=NVIDIA_H200.json"


@pytest.mark.parametrize("tp,dp,kv", [(8, 1, "bf16"), (8, 1, "fp8_e4m3"), (8, 8, "bf16"), (8, 8, "fp8_e4m3")])
def test_candidates_start_with_the_default_and_hold_no_duplicate(tp, dp, kv):
    shape = tm.mla_shape(V3, tp, dp, kv)
    cands = tm.tile_candidates(shape)
    assert cands[0] == default_config(shape.rows, shape.kv_dtype)
    assert len(set(cands)) == len(cands) and 8 <= len(cands) <= 40
    assert all(c.kv_load == "tile" for c in cands) == (kv == "bf16")
    assert all(c.block_h == 64 for c in cands if c.kv_load == "fp8dot")  # FP8 wgmma's tile (16 heads: padded)
    splits = tm.split_candidates(cands[0])
    assert len(splits) == len(tm.SPLIT_SETTINGS) and {c.block_n for c in splits} == {cands[0].block_n}


def test_config_ints_round_trip():
    for cfg in (DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, kv_load="fp8dot", fp16_math=True,
                             min_split_tokens=128, programs_per_sm=2.0), default_config(16, torch.bfloat16)):
        ints = config_to_ints(cfg)
        assert set(ints) == set(tc.MLA_DECODE_KEYS) and all(isinstance(v, int) for v in ints.values())
        assert config_from_ints({**ints, "FLASHINFER": 1}) == cfg
    with pytest.raises(ValueError, match="whole"):
        config_to_ints(DecodeConfig(programs_per_sm=1.5))


TINY = tm.MlaShape(heads=16, kv_lora_rank=64, rope_dim=16, kv_dtype=torch.bfloat16, sm_scale=0.1)


def _scripted_timer(calls):
    """µs that prefer block_n 32, then 2 programs per SM and 64-token splits, and grow with the context."""
    def timer(fn):
        cfg = fn.cfg
        calls.append(cfg)
        us = 10.0 + (0 if cfg.block_n == 32 else 5) + (0 if cfg.programs_per_sm == 2 else 1)
        return (us - (0.5 if cfg.min_split_tokens == 64 else 0)) * fn.ctx / 32
    return timer


def _tag_runs(monkeypatch):
    """DecodeProblem.run closures carry their config and context (for the scripted timer)."""
    run = tm.DecodeProblem.run

    def tagged(self, cfg):
        fn = run(self, cfg)
        wrapper = lambda: fn()  # noqa: E731
        wrapper.cfg, wrapper.ctx = cfg, self.ctx
        return wrapper
    monkeypatch.setattr(tm.DecodeProblem, "run", tagged)


def test_search_writes_the_fastest_and_resume_skips_what_is_done(monkeypatch, tmp_path):
    monkeypatch.setattr(tm, "SPLIT_SETTINGS", ((1, 256), (2, 64), (2, 256)))
    base = default_config(TINY.rows, TINY.kv_dtype)
    cands = [base, replace(base, block_n=32), replace(base, block_n=16, num_stages=2)]
    monkeypatch.setattr(tm, "tile_candidates", lambda shape: cands)
    _tag_runs(monkeypatch)
    calls, logs = [], []
    tuner = tm.MlaTuner(TINY, torch.device("cpu"), contexts=(32, 96), timer=_scripted_timer(calls), log=logs.append)
    path = tmp_path / TINY.filename("cpu")
    results = tm.tune_mla(tuner, [1, 3], path)
    want = replace(base, block_n=32, programs_per_sm=2.0, min_split_tokens=64)
    assert [r.config for r in results] == [want, want]
    assert math.isclose(results[0].tuned_us, 9.5 * math.sqrt(1 * 3), rel_tol=1e-9)  # geomean over ctx 32 / 96
    assert results[0].default_us > results[0].tuned_us and results[0].flashinfer_us is None
    table = tc.load_configs(path)
    assert sorted(table) == [1, 3] and config_from_ints(table[3]) == want and "FLASHINFER" not in table[3]
    calls.clear()
    again = tm.tune_mla(tuner, [1, 3, 5], path, resume=True)
    assert [r.batch for r in again] == [5] and sorted(tc.load_configs(path)) == [1, 3, 5]
    assert any("--resume" in line for line in logs)


def test_a_wrong_candidate_is_rejected(monkeypatch):
    """A config whose output fails the reference check never wins, however fast it times."""
    base = default_config(TINY.rows, TINY.kv_dtype)
    broken = replace(base, block_n=32)
    monkeypatch.setattr(tm, "tile_candidates", lambda shape: [base, broken])
    monkeypatch.setattr(tm, "SPLIT_SETTINGS", ((1, 256),))
    error = tm.DecodeProblem.error
    monkeypatch.setattr(tm.DecodeProblem, "error", lambda self, cfg: 1.0 if cfg == broken else error(self, cfg))
    tuner = tm.MlaTuner(TINY, torch.device("cpu"), contexts=(32,), timer=lambda fn: 1.0, log=lambda line: None)
    result = tuner.tune_batch(2)
    assert result.config.block_n == base.block_n and any("error 1.00e+00" in r for r in result.rejected)


def test_fp8dot_is_held_to_what_the_fp8_cache_itself_costs():
    """fp8dot rounds the queries to e4m3 too: the check bounds its error by the FP8 cache's own rounding error on the
    same problem (scores as sharp as V3's: std about 3), so the engine's default at 64+ rows passes, and a 16-bit
    path keeps the absolute bound."""
    shape = tm.MlaShape(heads=64, kv_lora_rank=64, rope_dim=16, kv_dtype=torch.float8_e4m3fn, sm_scale=0.36)
    tuner = tm.MlaTuner(shape, torch.device("cpu"), contexts=(64,), timer=lambda fn: 1.0, log=lambda line: None)
    fp8dot = default_config(shape.rows, shape.kv_dtype)
    assert fp8dot.kv_load == "fp8dot"
    bound = tuner.bound(fp8dot)
    assert 0.01 < tuner.check_cache_error < 0.2 and bound == pytest.approx(tm.FP8DOT_ERR_RATIO * tuner.check_cache_error)
    split = replace(fp8dot, kv_load="split")
    assert tuner.bound(split) == tm.ERR_BOUND["split"]
    err_fp8dot, err_split = tuner.check.error(fp8dot), tuner.check.error(split)
    assert err_split < 0.01 < err_fp8dot <= bound  # the queries' rounding is counted, and within the bound


def test_every_load_mode_has_an_error_bound():
    from kernels.mla_decode import KV_LOADS

    assert set(tm.ERR_BOUND) | {"fp8dot"} == set(KV_LOADS)


def test_the_engine_reads_the_table(tmp_path):
    """The look-up the decode kernel and the flashinfer-decode backend make: nearest tuned batch size; none beyond
    twice the largest, or without a file."""
    cfg = replace(default_config(16, torch.bfloat16), block_n=16, num_stages=2)
    tc.save_configs(tmp_path / tc.mla_decode_config_filename(16, "bf16", "Test GPU"),  # a GPU with no shipped table
                    {1: config_to_ints(cfg), 64: {**config_to_ints(default_config(16, torch.bfloat16)), "FLASHINFER": 1}})
    tc.clear_config_cache()
    look = dict(device_name_override="Test_GPU", user_dir=str(tmp_path))
    assert config_from_ints(tc.get_mla_decode_config(16, "bf16", 2, **look)) == cfg
    assert tc.get_mla_decode_config(16, "bf16", 40, **look)["FLASHINFER"] == 1
    assert tc.get_mla_decode_config(16, "bf16", 129, **look) is None  # beyond 2 x 64
    assert tc.get_mla_decode_config(16, "fp8_e4m3", 2, **look) is None  # no table for that cache
    tc.clear_config_cache()


def _invoke(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "200"})


def test_cli_dry_run_and_errors(tmp_path):
    res = _invoke("tune-mla", "--model", "deepseek-v3", "--tp", "8", "--dp", "8", "--dry-run", "--out-dir", tmp_path)
    assert res.exit_code == 0, res.output
    assert "128 heads per rank" in res.output
    assert "MLA_DECODE,H=128,kv_dtype=bf16,device_name={GPU}.json" in res.output
    assert "MLA_DECODE,H=128,kv_dtype=fp8_e4m3,device_name={GPU}.json" in res.output
    assert not any(tmp_path.iterdir())
    res = _invoke("tune-mla", "--dry-run", "--tp", "8", "--dp", "3")
    assert isinstance(res.exception, UsageError) and "--dp 3 must divide --tp 8" in str(res.exception)
    res = _invoke("tune-mla", "--dry-run", "--batch-sizes", "0,4")
    assert isinstance(res.exception, UsageError) and "batch sizes must be >= 1" in str(res.exception)
    res = _invoke("tune-mla", "--dry-run", "--contexts", "1k")
    assert isinstance(res.exception, UsageError) and "--contexts '1k': expected" in str(res.exception)
