"""Kernel config files: names, JSON round trip, nearest-M look-up, search order (argument, registered
user dir, shipped; never the environment), defaults, warnings."""

import json
import logging
import os

import pytest

from kernels import tuned_configs as tc


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.delenv(tc.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # no per-user configs of this machine's user
    tc.set_user_config_dir(None)
    tc.clear_config_cache()
    tc._warned.clear()
    yield
    tc.set_user_config_dir(None)
    tc.clear_config_cache()


def test_file_names():
    assert tc.moe_config_filename(256, 256, "NVIDIA H100 80GB HBM3", "fp8_w8a8") == \
        "E=256,N=256,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert tc.moe_config_filename(64, 1408, "NVIDIA_H200", "bf16", None) == \
        "E=64,N=1408,device_name=NVIDIA_H200,dtype=bf16.json"
    assert tc.fp8_gemm_config_filename(1536, 7168, "NVIDIA H200") == \
        "N=1536,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert tc.normalize_device_name(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3"


def test_device_name_without_gpu(monkeypatch):
    monkeypatch.setattr(tc.torch.cuda, "is_available", lambda: False)
    assert tc.device_name() == "cpu" and tc.device_name("cuda") == "cpu"


def _cfg(bm):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3)


def test_round_trip_and_nearest(tmp_path):
    configs = {64: _cfg(64), 1: _cfg(16), 4: _cfg(16), 16: _cfg(32)}
    path = tmp_path / "sub" / "x.json"
    tc.save_configs(path, configs)
    raw = json.loads(path.read_text())
    assert list(raw) == ["1", "4", "16", "64"]
    loaded = tc.load_configs(path)
    assert loaded == configs
    assert tc.nearest_config(loaded, 1)["BLOCK_SIZE_M"] == 16
    assert tc.nearest_config(loaded, 10)["BLOCK_SIZE_M"] == 16  # |10-4| == |10-16|: the smaller, 4
    assert tc.nearest_config(loaded, 11)["BLOCK_SIZE_M"] == 32
    assert tc.nearest_config(loaded, 5000)["BLOCK_SIZE_M"] == 64
    tc.save_configs(path, {8: _cfg(128)})  # rewriting is seen (cache keyed by mtime)
    assert set(tc.load_configs(path)) == {8}


def test_beyond_twice_the_largest_tuned_m_the_default_is_used(tmp_path, monkeypatch):
    """A file whose search stopped at M = 64 (its time limit) still serves decode sizes, but a prefill-sized
    M gets the default config, not the M = 64 tile."""
    monkeypatch.setattr(tc, "SHIPPED_DIR", tmp_path)
    tc.save_configs(tmp_path / tc.fp8_gemm_config_filename(24576, 1536, "Fake_GPU"), {1: _cfg(16), 64: _cfg(32)})
    tc.save_configs(tmp_path / tc.moe_config_filename(256, 2048, "Fake_GPU", "fp8_w8a8"), {1: _cfg(16), 512: _cfg(32)})

    def gemm(m):
        return tc.get_fp8_gemm_config(24576, 1536, m, device_name_override="Fake_GPU")

    def moe(m):
        return tc.get_moe_config(256, 2048, m, 8, "fp8_w8a8", device_name_override="Fake_GPU")

    assert gemm(1)["BLOCK_SIZE_M"] == 16 and gemm(128)["BLOCK_SIZE_M"] == 32
    assert gemm(129) == tc.default_fp8_gemm_config(129, 24576, 1536) and gemm(129)["BLOCK_SIZE_M"] != 32
    assert moe(1024)["BLOCK_SIZE_M"] == 32
    assert moe(4096) == tc.default_moe_config(4096, 256, 2048, 8, "fp8_w8a8")


def _write(d, name, bm):
    tc.save_configs(d / name, {1: _cfg(bm)})


def test_search_order(tmp_path, monkeypatch):
    name = tc.moe_config_filename(7, 33, "Fake_GPU", "fp8_w8a8")
    arg_dir, user_dir, shipped = tmp_path / "arg", tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setattr(tc, "SHIPPED_DIR", shipped)

    def get(**kw):
        return tc.get_moe_config(7, 33, 1, 2, "fp8_w8a8", device_name_override="Fake GPU", **kw)

    _write(shipped, name, 16)
    assert get()["BLOCK_SIZE_M"] == 16
    _write(user_dir, name, 32)
    assert get()["BLOCK_SIZE_M"] == 16  # not registered yet (and memoised results follow registration)
    tc.set_user_config_dir(user_dir)
    assert tc.user_config_dir() == user_dir and tc.config_dirs() == [user_dir, shipped]
    assert get()["BLOCK_SIZE_M"] == 32
    _write(arg_dir, name, 64)
    assert get(user_dir=arg_dir)["BLOCK_SIZE_M"] == 64
    tc.set_user_config_dir(None)
    assert get()["BLOCK_SIZE_M"] == 16
    gemm = tc.fp8_gemm_config_filename(576, 7168, "Fake_GPU")
    _write(shipped, gemm, 128)
    assert tc.get_fp8_gemm_config(576, 7168, 2, device_name_override="Fake_GPU")["BLOCK_SIZE_M"] == 128


def test_environment_is_not_a_search_path(tmp_path, monkeypatch):
    """DSCTL_KERNEL_CONFIG_DIR is the engine flag's default, resolved by the runner; look-ups never read it."""
    name = tc.fp8_gemm_config_filename(96, 64, "Fake_GPU")
    shipped, env_dir = tmp_path / "shipped", tmp_path / "env"
    monkeypatch.setattr(tc, "SHIPPED_DIR", shipped)
    _write(shipped, name, 16)
    _write(env_dir, name, 64)
    monkeypatch.setenv(tc.ENV_DIR, str(env_dir))
    assert tc.config_dirs() == [shipped]
    assert tc.get_fp8_gemm_config(96, 64, 1, device_name_override="Fake_GPU")["BLOCK_SIZE_M"] == 16


def test_user_dir_file_wins_over_shipped_without_touching_the_environment(tmp_path, monkeypatch):
    name = tc.moe_config_filename(5, 24, "Fake_GPU", "bf16", None)
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    monkeypatch.setattr(tc, "SHIPPED_DIR", shipped)
    _write(shipped, name, 16)
    _write(user, name, 128)
    before = dict(os.environ)
    tc.set_user_config_dir(str(user))
    got = tc.get_moe_config(5, 24, 1, 2, "bf16", device_name_override="Fake_GPU")
    assert got["BLOCK_SIZE_M"] == 128
    assert dict(os.environ) == before


def test_missing_file_defaults_and_warns_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="dsctl.kernels")
    cfg = tc.get_moe_config(256, 256, 64, 8, "fp8_w8a8", device_name_override="Fake GPU", user_dir=tmp_path)
    assert cfg == tc.default_moe_config(64, 256, 256, 8, "fp8_w8a8")
    tc.get_moe_config(256, 256, 128, 8, "fp8_w8a8", device_name_override="Fake GPU", user_dir=tmp_path)
    moe_msgs = [r.getMessage() for r in caplog.records]
    assert len(moe_msgs) == 1
    assert "dsctl tune-moe" in moe_msgs[0] and "E=256,N=256,device_name=Fake_GPU" in moe_msgs[0]
    assert str(tmp_path) in moe_msgs[0]
    caplog.clear()
    tc.get_fp8_gemm_config(1536, 7168, 4, device_name_override="Fake GPU")
    tc.get_fp8_gemm_config(1536, 7168, 4000, device_name_override="Fake GPU")
    assert len(caplog.records) == 1 and "dsctl tune-fp8" in caplog.records[0].getMessage()
    caplog.clear()
    tc.get_moe_config(256, 256, 64, 8, "bf16", device_name_override="cpu")  # no GPU: nothing to tune
    assert not caplog.records


@pytest.mark.parametrize("m", [1, 16, 64, 512, 4096])
def test_defaults_are_valid(m):
    for cfg in (tc.default_moe_config(m, 256, 256, 8, "fp8_w8a8"), tc.default_moe_config(m, 160, 192, 6, "bf16"),
                tc.default_fp8_gemm_config(m, 1536, 7168)):
        assert set(tc.CONFIG_KEYS) <= set(cfg)
        for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "BLOCK_SIZE_N_DOWN"):
            v = cfg.get(key, 16)
            assert v >= 16 and v & (v - 1) == 0
        assert 128 % cfg["BLOCK_SIZE_K"] == 0 or cfg["BLOCK_SIZE_K"] % 128 == 0


def test_shipped_files_parse():
    assert tc.SHIPPED_DIR.is_dir()
    for path in tc.SHIPPED_DIR.glob("*.json"):
        assert path.name.startswith(("E=", "N=", "MLA_DECODE,")) and ",device_name=" in path.name
        configs = tc.load_configs(path)
        assert configs
        keys = tc.MLA_DECODE_KEYS if path.name.startswith("MLA_DECODE,") else tc.CONFIG_KEYS
        for cfg in configs.values():
            assert set(keys) <= set(cfg)
