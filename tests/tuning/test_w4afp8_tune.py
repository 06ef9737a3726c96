"""`dsctl tune-moe --dtype w4afp8`: the shape, file name and search space of the INT4-expert kernel (dry run),
and its benchmark problem (random packed INT4 experts) checked against the reference under the interpreter."""

import pytest
import torch
from typer.testing import CliRunner

from dsctl.cli import app
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from kernels import tuned_configs as tc
from tuning import search_space as ss
from tuning.bench import Bench, MoEProblem, Timer
from tuning.shapes import moe_shape


def test_dry_run_v3_tp8_w4afp8(tmp_path):
    res = CliRunner().invoke(app, ["tune-moe", "--model", "deepseek-v3", "--tp", "8", "--dtype", "w4afp8",
                                   "--dry-run", "--out-dir", str(tmp_path), "--batch-sizes", "1,64"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "E=256 N=256 K=7168 top-8 w4afp8" in res.output
    assert "E=256,N=256,device_name={GPU},dtype=w4afp8.json" in res.output
    assert not any(tmp_path.iterdir())


def test_search_space_respects_the_int4_group():
    up, down = ss.moe_kinds(64, 7168, "w4afp8", None)
    assert up.block_shape == (1, 128) and down.block_shape == (1, 64)  # a 64-column TP slice: one group
    kept = ss.moe_candidates(64, 64, 7168, 8, 256, "w4afp8", None, ss.Limits()).kept
    assert kept and all(c["BLOCK_SIZE_K"] <= 64 for c in kept)  # K tiles of the down GEMM fit its group
    assert tc.default_moe_config(1, 256, 256, 8, "w4afp8")["BLOCK_SIZE_K"] == 128
    # gate_up of V3 at TP 8: K tiles of whole groups only where the swapped kernel runs (64+ weight rows), and
    # no tile smaller than a group there (the swapped kernel would step a whole group anyway)
    kept = ss.moe_candidates(64, 256, 7168, 8, 256, "w4afp8", None, ss.Limits()).kept
    assert {c["BLOCK_SIZE_K"] for c in kept if c["BLOCK_SIZE_N"] >= 64} == {128, 256}
    assert {c["BLOCK_SIZE_K"] for c in kept if c["BLOCK_SIZE_N"] < 64} <= {64, 128}


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; on a GPU tune-moe runs it at real shapes")
def test_problem_matches_reference():
    cfg = parse_config({**lookup("tiny-fp8").config_dict(), "num_experts_per_tok": 2})
    shape = moe_shape(cfg, tp=2, dtype="w4afp8")
    assert (shape.N, shape.block_shape) == (64, None)
    problem = MoEProblem(shape, "cpu")
    assert problem.w13.dtype == torch.int8 and problem.w2_scale.shape == (16, 256, 1)
    bench = Bench(problem, 3, Timer("cpu"))
    assert bench.check(dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64)) < problem.tolerance() / 10
