"""`dsctl tune-moe` / `tune-fp8` from the command line: dry run, no-GPU error, option errors, and a tiny
real tuning run under the Triton interpreter (a subprocess, so TRITON_INTERPRET is set before triton loads)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from dsctl.cli import app
from engine.errors import DsctlError, UsageError
from kernels import tuned_configs as tc
from tests.tuning.conftest import run_dsctl


def _invoke(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "200"})


def test_dry_run_v3_tp8(tmp_path):
    res = _invoke("tune-moe", "--model", "deepseek-v3", "--tp", "8", "--dry-run", "--out-dir", tmp_path,
                  "--verify-exhaustive", "8,256")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "E=256 N=256 K=7168 top-8 fp8_w8a8" in out
    assert "E=256,N=256,device_name={GPU},dtype=fp8_w8a8,block_shape=[128, 128].json" in out
    assert "grid of 240 configs" in out and "grid of 1920 configs" in out  # staged, then the verify grid
    assert "shared memory" in out and "estimated time" in out
    assert str(tmp_path) in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_ep_and_fp8_shapes():
    res = _invoke("tune-moe", "--model", "deepseek-v3", "--tp", "8", "--ep", "8", "--dry-run", "--batch-sizes", "1,64")
    assert res.exit_code == 0, res.output
    assert "E=32 N=2048" in res.output
    res = _invoke("tune-moe", "--model", "deepseek-v3", "--tp", "8", "--ep-size", "8", "--dry-run",
                  "--batch-sizes", "1")
    assert res.exit_code == 0 and "E=32 N=2048" in res.output, res.output  # the engine's flag name works too
    res = _invoke("tune-fp8", "--model", "deepseek-v3", "--tp", "8", "--dry-run", "--shapes", "2112x7168,7168x2048",
                  "--batch-sizes", "1,64")
    assert res.exit_code == 0, res.output
    assert "N=2112 K=7168 (qkv_a_proj)" in res.output and "N=7168 K=2048 (o_proj)" in res.output
    assert "kv_b_proj" not in res.output
    res = _invoke("tune-fp8", "--model", "deepseek-v3", "--dry-run", "--max-shapes", "2", "--batch-sizes", "1")
    assert res.exit_code == 0 and res.output.count("block-FP8 GEMM") == 2


@pytest.mark.parametrize("args, match", [
    (("tune-fp8", "--model", "deepseek-v3", "--shapes", "100x100"), "not a GEMM"),
    (("tune-fp8", "--model", "deepseek-v3", "--shapes", "abc"), "NxK"),
    (("tune-moe", "--model", "deepseek-v3", "--ep", "3"), "divide"),
    (("tune-moe", "--model", "deepseek-v3", "--batch-sizes", "0"), ">= 1"),
    (("tune-moe", "--model", "deepseek-v3", "--verify-exhaustive", "8", "--exhaustive"), "one of them"),
])
def test_option_errors(args, match):
    res = _invoke(*args, "--dry-run")
    assert isinstance(res.exception, UsageError) and match in str(res.exception)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when there is no GPU")
def test_no_gpu_error_is_one_line(tiny_model):
    res = run_dsctl("tune-moe", "--model", tiny_model, "--tp", "1", interpret=False, timeout=120)
    assert res.returncode != 0
    err = res.stderr.strip()
    assert err.startswith("error: tune-moe needs a CUDA GPU") and len(err.splitlines()) == 1
    assert "Traceback" not in res.stderr
    from tuning.errors import NoGpuError
    assert issubclass(NoGpuError, DsctlError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (on a GPU the real one is a benchmark)")
def test_tiny_real_run_under_interpreter(tiny_model, tmp_path):
    """Real kernels, real timing loop, numerical check, file written, look-up reads it back; then resume and
    the staged-vs-exhaustive comparison on the GEMM."""
    out = tmp_path / "configs"
    res = run_dsctl("tune-moe", "--model", tiny_model, "--tp", "1", "--batch-sizes", "1", "--out-dir", out,
                    "--grid", "tiny", "--max-configs", "1", "--workers", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    name = tc.moe_config_filename(4, 128, "cpu", "fp8_w8a8")
    assert (out / name).is_file(), res.stdout
    tc.clear_config_cache()
    cfg = tc.get_moe_config(4, 128, 2, 2, "fp8_w8a8", device_name_override="cpu", user_dir=out)
    assert cfg == tc.load_configs(out / name)[1]
    assert cfg["BLOCK_SIZE_M"] == 16  # M=1 x top-2 over 4 experts: larger row tiles are pruned
    assert "speed-up" in res.stdout and "no config passed" not in res.stdout

    res = run_dsctl("tune-fp8", "--model", tiny_model, "--tp", "1", "--shapes", "128x128", "--batch-sizes", "1",
                    "--out-dir", out, "--grid", "tiny", "--workers", "1", "--verify-exhaustive", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    gemm = tc.fp8_gemm_config_filename(128, 128, "cpu")
    assert set(tc.load_configs(out / gemm)) == {1}
    verify = json.loads((out / f"verify-{gemm[:-5]}.json").read_text())
    row, = verify["rows"]
    assert row["m"] == 1 and row["exhaustive_timed"] >= 4 and row["best"] and row["staged_us"] > 0

    # resume: M=1 is already there, only M=16 is tuned; the file ends with both
    res = run_dsctl("tune-fp8", "--model", tiny_model, "--tp", "1", "--shapes", "128x128", "--batch-sizes", "1,16",
                    "--out-dir", out, "--grid", "tiny", "--workers", "1", "--resume", "--max-configs", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resuming: 1 batch size(s)" in res.stdout
    assert set(tc.load_configs(out / gemm)) == {1, 16}
