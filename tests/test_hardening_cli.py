"""Start-up hardening in-process (no server runs): `dsctl --version`, one-line exit-2 errors for every bad
`--model` form, the DP-attention warning said once, and tuned configs in the per-user directory."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from dsctl import cmd_tune
from dsctl.cli import main
from engine.args import EngineArgs
from engine.runtime.launch_checks import check_launch, launch_args
from kernels import tuned_configs as tc


def _run_cli(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["dsctl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_version(monkeypatch, capsys):
    code, out, _ = _run_cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"dsctl {version('dsctl')}"


def test_bad_model_forms_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "weights.safetensors"
    afile.write_text("")
    (tmp_path / "empty").mkdir()
    forms = {str(tmp_path / "missing"): "no such directory", "./not/here": "no such directory",
             "~/surely-not-here-dsctl": "no such directory", "org/": "not a hub repo id",
             "org/name:rev": "not a hub repo id", "-x/y": "not a hub repo id", "a/b/c": "no such directory",
             "": "must not be empty", str(afile): "is a file", str(tmp_path / "empty"): "no config.json",
             "nonsense": "unknown model", "no-such-org/no-such-model": "is not downloaded"}
    for model, what in forms.items():
        code, _, err = _run_cli(monkeypatch, capsys, "serve", "--model", model, "--port", "1")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and what in lines[0], (model, err)


def test_dp_attention_warning_is_said_once(caplog):
    args = EngineArgs.of(model="tiny", device="cpu", enable_dp_attention=True)
    with caplog.at_level(logging.WARNING):
        check_launch(launch_args(args))  # what serve / generate / bench do: both look at the DP span
    said = [r for r in caplog.records if "--enable-dp-attention" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_tuned_configs_default_to_the_per_user_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(tc.ENV_DIR, raising=False)
    mine = tmp_path / "xdg" / "dsctl" / "configs"
    assert tc.per_user_dir() == mine
    assert cmd_tune.resolve_out_dir(None) == mine  # the default output: not the source tree
    assert not str(cmd_tune.resolve_out_dir(None)).startswith(str(tc.SHIPPED_DIR.parent))
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "env"))
    assert cmd_tune.resolve_out_dir(None) == tmp_path / "env"
    # The look-up: an explicit directory, then the per-user one (once it exists), then the shipped configs.
    assert tc.config_dirs() == [tc.SHIPPED_DIR]
    name = tc.fp8_gemm_config_filename(640, 320, "Fake_GPU")
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    tc.save_configs(mine / name, {1: dict(cfg, BLOCK_SIZE_M=32)})
    tc.save_configs(tmp_path / "explicit" / name, {1: dict(cfg, BLOCK_SIZE_M=64)})
    assert tc.config_dirs() == [mine, tc.SHIPPED_DIR]
    assert tc.config_dirs(tmp_path / "explicit") == [Path(tmp_path / "explicit"), mine, tc.SHIPPED_DIR]
    assert tc.find_config_file(name) == mine / name
    assert tc.find_config_file(name, tmp_path / "explicit") == tmp_path / "explicit" / name
