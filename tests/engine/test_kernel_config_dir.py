"""--kernel-config-dir reaches the kernels' config look-up through kernels.tuned_configs.set_user_config_dir:
the runner registers it (or its documented default, $DSCTL_KERNEL_CONFIG_DIR) and writes no environment."""

import os

import pytest

from engine.args import KERNEL_CONFIG_DIR_ENV, EngineArgs, KernelArgs
from engine.runner.model_runner import ModelRunner
from kernels import tuned_configs as tc


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(KERNEL_CONFIG_DIR_ENV, raising=False)
    tc.set_user_config_dir(None)
    tc.clear_config_cache()
    yield
    tc.set_user_config_dir(None)
    tc.clear_config_cache()


def _runner(**kw):
    return ModelRunner(EngineArgs.of(model="tiny", device="cpu", max_total_tokens=256, max_running_requests=4, **kw))


def test_flag_is_registered_and_wins_without_writing_the_environment(tmp_path, monkeypatch):
    name = tc.moe_config_filename(3, 40, "Fake_GPU", "bf16", None)
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    monkeypatch.setattr(tc, "SHIPPED_DIR", shipped)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    tc.save_configs(shipped / name, {1: cfg})
    tc.save_configs(user / name, {1: dict(cfg, BLOCK_SIZE_M=64)})
    before = dict(os.environ)
    _runner(kernel_config_dir=str(user))
    assert dict(os.environ) == before
    assert tc.user_config_dir() == user
    assert tc.get_moe_config(3, 40, 1, 2, "bf16", device_name_override="Fake_GPU")["BLOCK_SIZE_M"] == 64
    _runner()  # a later runner without the flag searches the shipped configs only
    assert tc.user_config_dir() is None
    assert tc.get_moe_config(3, 40, 1, 2, "bf16", device_name_override="Fake_GPU")["BLOCK_SIZE_M"] == 16


def test_environment_variable_is_the_flag_default(tmp_path, monkeypatch):
    env_dir, flag_dir = tmp_path / "env", tmp_path / "flag"
    env_dir.mkdir()
    flag_dir.mkdir()
    monkeypatch.setenv(KERNEL_CONFIG_DIR_ENV, str(env_dir))
    assert KernelArgs().config_dir() == str(env_dir)
    assert KernelArgs(kernel_config_dir=str(flag_dir)).config_dir() == str(flag_dir)
    before = dict(os.environ)
    _runner()
    assert tc.user_config_dir() == env_dir and dict(os.environ) == before
    monkeypatch.delenv(KERNEL_CONFIG_DIR_ENV)
    assert KernelArgs().config_dir() is None
