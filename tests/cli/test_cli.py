"""The dsctl command line: fast help, offline generation, one-line errors on bad input."""

import subprocess
import sys
import time

import pytest


def dsctl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsctl", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands_quickly_without_torch():
    start = time.perf_counter()
    res = dsctl("--help")
    elapsed = time.perf_counter() - start
    assert res.returncode == 0
    for cmd in ("models", "generate"):
        assert cmd in res.stdout
    assert elapsed < 5  # includes interpreter start-up; the import check below is the strict one
    probe = subprocess.run([sys.executable, "-c", "import sys, dsctl.cli; print('torch' in sys.modules, 'triton' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "False False"


def test_models_lists_aliases():
    res = dsctl("models")
    assert res.returncode == 0
    for alias in ("deepseek-v3", "deepseek-r1", "deepseek-v2-lite", "tiny"):
        assert alias in res.stdout


def test_generate_tiny_json():
    import json

    res = dsctl("generate", "--prompt", "Hello", "--prompt", "Hi there", "--max-new-tokens", "5", "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "Hi there"]
    assert all(len(r["token_ids"]) <= 5 for r in rows)


def _one_line_error(res, pattern):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error:"), res.stderr
    assert pattern in res.stderr, res.stderr


def test_unknown_alias():
    _one_line_error(dsctl("generate", "-p", "x", "--model", "deepseek-v9"), "unknown model")


def test_directory_without_config(tmp_path):
    _one_line_error(dsctl("generate", "-p", "x", "--model", str(tmp_path)), "config.json")


def test_checkpoint_with_deleted_shard(tmp_path):
    import shutil

    from engine.checkpoint.registry import lookup
    from engine.checkpoint.tiny import materialize

    ckpt = tmp_path / "ckpt"
    shutil.copytree(materialize("tiny", lookup("tiny").config_dict()), ckpt)
    (ckpt / "model-00003-of-00003.safetensors").unlink()
    _one_line_error(dsctl("generate", "-p", "x", "--model", str(ckpt)), "model-00003-of-00003.safetensors")


def test_prompt_longer_than_context():
    _one_line_error(dsctl("generate", "-p", "x" * 80, "--max-model-len", "64"), "context")


@pytest.mark.parametrize("flag,value", [("--dtype", "float64"), ("--num-layers", "0"), ("--load-format", "pt")])
def test_bad_flag_values(flag, value):
    res = dsctl("generate", "-p", "x", flag, value)
    _one_line_error(res, flag)


@pytest.mark.parametrize("extra,needle", [
    (("--attention-backend", "flashinfer"), "needs a CUDA GPU"),
    (("--enable-flashinfer-mla", "--attention-backend", "triton"), "give only one"),
    (("--kv-cache-dtype", "fp8_e5m2"), "CUDA GPU"),
    (("--enable-torch-compile", "--disable-cuda-graph"), "--enable-torch-compile"),
    (("--disable-mla", "--attention-backend", "flashinfer"), "FlashInfer's MLA wrapper cannot read"),
    (("--disable-mla", "--enable-flashinfer-mla"), "--disable-mla keeps expanded per-head K/V"),
])
def test_unsupported_combinations_rejected_at_startup(extra, needle):
    _one_line_error(dsctl("generate", "-p", "x", *extra), needle)
