"""The shipped tuned configs cover the one-GPU and TP-8 shapes on an H100, and the one-GPU shapes on an
H200 (issue 16, target 7).

A serving run reads one fused-MoE file per model shape and one block-FP8 GEMM file per linear
shape (kernels/tuned_configs.py); a missing file falls back to untuned defaults with a warning.
These checks need no GPU: they derive the shapes the engine asks for (tuning/shapes.py, the same
code `dsctl tune-*` uses) and look for the files in kernels/configs/.
"""

import pytest

from kernels.tuned_configs import config_dirs, load_configs
from tuning.shapes import gemm_shapes, load_model_config, moe_shape

H100 = "NVIDIA_H100_80GB_HBM3"
H200 = "NVIDIA_H200"
SHIPPED = config_dirs(None)[-1]

# (model, --tp, --ep-size): one GPU (TP 1; a DP-attention rank with EP 8 runs E=32 local experts), and TP 8.
DEPLOYMENTS = [("deepseek-v3", 1, 1), ("deepseek-v3", 8, 1), ("deepseek-v3", 8, 8), ("deepseek-r1", 1, 1),
               ("deepseek-v2-lite", 1, 1)]


def _check(path, largest_m=2048):
    """`largest_m`: the tuned batch sizes must reach it (the H200 searches of one time-limited run stopped
    at M = 64-1024 on some shapes; beyond twice a file's largest M the engine takes the default config)."""
    assert path.is_file(), f"missing {path.name}"
    configs = load_configs(path)
    assert min(configs) == 1 and max(configs) >= largest_m, f"{path.name}: tuned M {sorted(configs)}"
    for cfg in configs.values():
        assert {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"} <= set(cfg)


@pytest.mark.parametrize("model,tp,ep", DEPLOYMENTS)
def test_fused_moe_config_shipped(model, tp, ep):
    _check(SHIPPED / moe_shape(load_model_config(model), tp=tp, ep=ep).filename(H100))


@pytest.mark.parametrize("model,tp", [("deepseek-v3", 1), ("deepseek-v3", 8)])
def test_every_block_fp8_gemm_config_shipped(model, tp):
    for shape in gemm_shapes(load_model_config(model), tp=tp):
        _check(SHIPPED / shape.filename(H100))


ONE_GPU = [d for d in DEPLOYMENTS if d[1] == 1 or d[2] == 8]


@pytest.mark.parametrize("model,tp,ep", ONE_GPU)
def test_h200_fused_moe_config_shipped(model, tp, ep):
    _check(SHIPPED / moe_shape(load_model_config(model), tp=tp, ep=ep).filename(H200), largest_m=512)


@pytest.mark.parametrize("tp", [2, 4])
def test_v2_decode_configs_shipped(tp):
    """V2 (bf16, served with --quantization fp8) at TP 2 and 4 on an H100: every GEMM tuned for decode batches
    (M 1-16, split-K included; beyond 32 rows the engine takes the default, cuBLASLt from M = 16); at TP 4 also
    the fused MoE (E=160, N=384 fp8, M 1-256)."""
    v2 = load_model_config("deepseek-v2")
    for shape in gemm_shapes(v2, tp=tp):
        _check(SHIPPED / shape.filename(H100), largest_m=16)
    if tp == 4:
        _check(SHIPPED / moe_shape(v2, tp=4, dtype="fp8_w8a8").filename(H100), largest_m=256)


def test_h200_every_block_fp8_gemm_config_shipped():
    for shape in gemm_shapes(load_model_config("deepseek-v3"), tp=1):
        _check(SHIPPED / shape.filename(H200), largest_m=64)


@pytest.mark.parametrize("tp,dp", [(8, 1), (8, 8)])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_h200_mla_decode_tables_shipped(tp, dp, kv):
    """`dsctl tune-mla --model deepseek-v3 --tp 8 [--dp 8]` on an H200: 16 heads per rank (TP 8) and 128 (DP attention,
    or one GPU), bf16 and e4m3 caches, decode batches 1-256; every entry a launch config the kernel reads back."""
    from kernels.mla_decode import KV_LOADS, config_from_ints
    from kernels.tuned_configs import MLA_DECODE_KEYS
    from tuning.mla_decode import mla_shape

    shape = mla_shape(load_model_config("deepseek-v3"), tp, dp, kv)
    path = SHIPPED / shape.filename(H200)
    assert path.is_file(), f"missing {path.name}"
    table = load_configs(path)
    assert sorted(table) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for entry in table.values():
        assert set(MLA_DECODE_KEYS) <= set(entry) and entry["FLASHINFER"] in (0, 1)
        cfg = config_from_ints(entry)
        assert cfg.kv_load in KV_LOADS and cfg.block_h in (16, 32, 64)
