"""Shape derivation from the model config and the parallel layout; file names; batch-size lists."""

import pytest

from engine.errors import UsageError
from kernels import tuned_configs as tc
from tuning.shapes import DEFAULT_BATCH_SIZES, gemm_shapes, load_model_config, moe_shape, parse_batch_sizes


@pytest.fixture(scope="module")
def v3():
    return load_model_config("deepseek-v3")


@pytest.mark.parametrize("tp, ep, e, n", [(1, 1, 256, 2048), (8, 1, 256, 256), (8, 8, 32, 2048), (8, 2, 128, 512),
                                          (4, 1, 256, 512)])
def test_v3_moe_shape(v3, tp, ep, e, n):
    s = moe_shape(v3, tp=tp, ep=ep)
    assert (s.E, s.N, s.K, s.top_k) == (e, n, 7168, 8)
    assert s.dtype == "fp8_w8a8" and s.block_shape == (128, 128)
    assert s.routing.n_experts == 256 and s.routing.method == "noaux_tc"
    assert s.routing.n_group == 8 and s.routing.topk_group == 4


def test_moe_file_name_matches_lookup(v3):
    s = moe_shape(v3, tp=8)
    name = s.filename("NVIDIA H100 80GB HBM3")
    assert name == "E=256,N=256,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert name == tc.moe_config_filename(256, 256, "NVIDIA_H100_80GB_HBM3", "fp8_w8a8")
    assert (tc.SHIPPED_DIR / name).is_file()  # the shipped file of the same shape has the same name
    bf16 = moe_shape(v3, tp=8, dtype="bf16")
    assert bf16.block_shape is None
    assert bf16.filename("NVIDIA H200") == "E=256,N=256,device_name=NVIDIA_H200,dtype=bf16.json"


def test_moe_shape_errors(v3):
    with pytest.raises(UsageError, match="divide"):
        moe_shape(v3, tp=8, ep=3)
    with pytest.raises(UsageError, match="128-wide"):
        moe_shape(v3, tp=32)  # 2048 / 32 = 64: not a multiple of the weight block
    with pytest.raises(UsageError, match="--dtype"):
        moe_shape(v3, tp=8, dtype="int4")


def test_v3_tp8_gemm_shapes(v3):
    shapes = {(s.N, s.K): s.layers for s in gemm_shapes(v3, tp=8)}
    assert shapes == {
        (2112, 7168): ("qkv_a_proj",), (3072, 1536): ("q_b_proj",),
        (4096, 512): ("kv_b_proj",), (7168, 2048): ("o_proj",), (4608, 7168): ("mlp.gate_up_proj",),
        (7168, 2304): ("mlp.down_proj",), (512, 7168): ("shared_experts.gate_up_proj",),
        (7168, 256): ("shared_experts.down_proj",)}
    one = {(s.N, s.K) for s in gemm_shapes(v3, tp=1)}
    assert {(24576, 1536), (7168, 16384), (36864, 7168), (4096, 7168)} <= one
    assert [(s.N, s.K) for s in gemm_shapes(v3, tp=8, layers=["o_proj"])] == [(7168, 2048)]
    name = gemm_shapes(v3, tp=8, layers=["qkv_a"])[0].filename("NVIDIA H100 80GB HBM3")
    assert name == "N=2112,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert (tc.SHIPPED_DIR / name).is_file()


def test_bf16_model_lists_the_gemms_quantization_fp8_serves():
    """V2 is a bf16 checkpoint served with --quantization fp8 (128 x 128 blocks of each rank's slice): tune-fp8
    tunes those shapes; a rank's K need not be whole blocks (V2-Lite's 10,944-wide dense MLP)."""
    v2 = {(s.N, s.K) for s in gemm_shapes(load_model_config("deepseek-v2"), tp=4)}
    assert {(2112, 5120), (5120, 4096), (1536, 5120), (5120, 768)} <= v2
    assert all(s.block_shape == (128, 128) for s in gemm_shapes(load_model_config("deepseek-v2"), tp=4))
    assert (2048, 10944) in {(s.N, s.K) for s in gemm_shapes(load_model_config("deepseek-v2-lite"), tp=1)}


def test_batch_sizes():
    assert parse_batch_sizes(None) == list(DEFAULT_BATCH_SIZES) and len(DEFAULT_BATCH_SIZES) == 18
    assert parse_batch_sizes("8, 1,8,4096") == [1, 8, 4096]
    for bad in ("1,x", "0,4"):
        with pytest.raises(UsageError):
            parse_batch_sizes(bad)


def test_unknown_model():
    with pytest.raises(UsageError, match="neither"):
        load_model_config("no-such-model-xyz")


@pytest.mark.parametrize("tp", [1, 8])
def test_gemm_shapes_are_the_shapes_the_engine_runs(v3, tp):
    """Every block-FP8 Linear of a built V3 rank (on the meta device, after the post-load step that merges
    gate and up) has an (N, K) that gemm_shapes lists, and the other way round: a tuned file then serves each
    GEMM the engine launches (the dense gate / up once ran unmerged and never found their merged files; so
    would q_a / kv_a, now one qkv_a_proj of N = 1536 + 576)."""
    import torch

    from engine.distributed.groups import TPGroup
    from engine.model.builder import derive_weights, make_modules
    from engine.model.layers import Linear

    cfg = v3.with_num_layers(4)  # three dense layers and one MoE layer: every linear shape of the model
    group = TPGroup(rank=0, size=tp, ranks=tuple(range(tp)))
    with torch.device("meta"):
        modules = make_modules(cfg, cfg.num_hidden_layers, torch.bfloat16, (128, 128), group, mtp=False)
        derive_weights(modules)  # meta tensors: absorb's views and the merge's cat need no values
    run = {tuple(m.weight.shape) for m in modules[""].modules() if isinstance(m, Linear) and m.fp8_block is not None}
    listed = {(s.N, s.K) for s in gemm_shapes(v3, tp)}
    assert run == listed
