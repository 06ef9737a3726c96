"""ParallelConfig validation and the TP-size checks against real model configs: one-line fix-it messages."""

from dataclasses import replace

import pytest

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed.divisibility import check_model_divisible, working_tp_sizes
from engine.distributed.parallel_config import ParallelConfig, parse_host_port
from engine.errors import UsageError


def config(alias: str):
    return parse_config(lookup(alias).config_dict())


def usage_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    msg = str(exc.value)
    assert "\n" not in msg, "user errors are one line"
    return msg


def test_world_and_ranks():
    pc = ParallelConfig(tp_size=16, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", base_gpu_id=0)
    pc.validate("cuda", visible_gpus=8)
    assert pc.world_size == 16 and pc.ranks_per_node == 8
    assert [pc.global_rank(i) for i in (0, 7)] == [8, 15]
    assert pc.init_method() == "tcp://10.0.0.1:5000"
    assert replace(pc, dist_init_addr="[fe80::1]:29500").init_method() == "tcp://[fe80::1]:29500"


def test_nnodes_needs_init_addr():
    msg = usage_error(ParallelConfig(tp_size=4, nnodes=2).validate)
    assert "--nnodes 2" in msg and "--dist-init-addr HOST:PORT" in msg


def test_world_not_divisible_by_nodes():
    msg = usage_error(ParallelConfig(tp_size=6, nnodes=4, dist_init_addr="h:1").validate)
    assert "--tp 6" in msg and "--nnodes 4" in msg and "multiple of 4" in msg


def test_more_local_ranks_than_gpus():
    pc = ParallelConfig(tp_size=8)
    msg = usage_error(pc.validate, "cuda", visible_gpus=4)
    assert "4 GPU(s) are visible" in msg and "--tp 4" in msg
    msg = usage_error(replace(pc, tp_size=4, base_gpu_id=2).validate, "cuda", visible_gpus=4)
    assert "GPUs 2..5" in msg
    pc.validate("cpu", visible_gpus=0)  # CPU ranks need no GPU
    replace(pc, tp_size=4).validate("cuda", visible_gpus=4)


@pytest.mark.parametrize("addr", ["localhost", "host:", ":5000", "host:99999", "host:0", "a b:1", "host:5000:1"])
def test_malformed_host_port(addr):
    msg = usage_error(ParallelConfig(tp_size=2, dist_init_addr=addr).validate)
    assert "is not HOST:PORT" in msg and repr(addr) in msg


def test_parse_host_port():
    assert parse_host_port("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_host_port("node-0.cluster:1") == ("node-0.cluster", 1)
    assert parse_host_port("[::1]:80") == ("::1", 80)


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp_size=0), "--tp-size must be >= 1"),
    (dict(node_rank=1), "--node-rank 1"),
    (dict(dist_timeout=0), "--dist-timeout"),
    (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "dividing --tp 4"),
    (dict(tp_size=4, dp_size=8, enable_dp_attention=True), "dividing --tp 4"),
    (dict(tp_size=4, dp_size=2), "needs --enable-dp-attention"),
    (dict(tp_size=4, ep_size=2), "must equal --tp 4"),
    (dict(tp_size=2, moe_a2a_backend="torch"), "needs expert parallelism"),
])
def test_other_flag_errors(kwargs, words):
    assert words in usage_error(ParallelConfig(**kwargs).validate)


@pytest.mark.parametrize("kwargs", [dict(tp_size=4, dp_size=2, enable_dp_attention=True),
                                    dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2),
                                    dict(tp_size=4, ep_size=4),
                                    dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2,
                                         moe_a2a_backend="torch")])
def test_dp_attention_and_ep_layouts_are_accepted(kwargs):
    pc = ParallelConfig(**kwargs)
    pc.validate()
    assert pc.world_size == kwargs["tp_size"]
    assert pc.attn_tp_size == kwargs["tp_size"] // kwargs.get("dp_size", 1)


def test_ep_must_divide_the_experts():
    tiny = config("tiny")
    check_model_divisible(tiny, 4, ep_size=4)
    msg = usage_error(check_model_divisible, replace(tiny, n_routed_experts=6), 4, ep_size=4)
    assert "--ep-size 4 does not divide n_routed_experts = 6" in msg
    # EP keeps each expert's whole intermediate size: tiny-fp8 (moe_intermediate 128) stays FP8 at EP 2 / 4,
    # which TP's intermediate split refuses
    fp8 = config("tiny-fp8")
    usage_error(check_model_divisible, fp8, 2, (128, 128))
    for ep in (2, 4):
        check_model_divisible(fp8, ep, (128, 128), ep_size=ep)


def test_dp_attention_splits_attention_over_tp_over_dp():
    tiny = config("tiny")  # 4 heads: --tp 16 alone does not split them; --tp 16 --dp 4 (attention TP 4) does
    wide = replace(tiny, n_routed_experts=16, moe_intermediate_size=256, intermediate_size=512)
    usage_error(check_model_divisible, wide, 16)
    check_model_divisible(wide, 16, attn_tp_size=4)
    msg = usage_error(check_model_divisible, wide, 16, attn_tp_size=8)
    assert "DP attention's attention TP (--tp / --dp = 8)" in msg and "larger --dp" in msg


def test_tp_must_divide_heads_and_sizes():
    tiny = config("tiny")
    for tp in (1, 2, 4):
        check_model_divisible(tiny, tp)
    msg = usage_error(check_model_divisible, tiny, 3)
    assert "num_attention_heads (MLA is split by heads) = 4" in msg and "1, 2, 4" in msg
    msg = usage_error(check_model_divisible, replace(tiny, vocab_size=322), 4)
    assert "vocab_size" in msg and "322" in msg and "TP sizes that work for this model: 1, 2" in msg
    msg = usage_error(check_model_divisible, replace(tiny, intermediate_size=500, num_attention_heads=8), 8)
    assert "intermediate_size" in msg and "500" in msg
    # an all-MoE model (no dense layer) is not constrained by intermediate_size
    check_model_divisible(replace(tiny, intermediate_size=500, first_k_dense_replace=0), 4)
    msg = usage_error(check_model_divisible, replace(tiny, moe_intermediate_size=90), 4)
    assert "moe_intermediate_size" in msg and "90" in msg


def test_fp8_blocks():
    fp8 = config("tiny-fp8")
    # weights kept FP8: tiny-fp8's expert w13 would be 64 rows per rank at TP 2 -> rejected, named, with a way out
    msg = usage_error(check_model_divisible, fp8, 2, (128, 128))
    assert "w13" in msg and "128 / 2 = 64 per rank" in msg and "128-wide FP8 block" in msg
    assert "TP sizes that work for this model: 1" in msg and "--quantization none" in msg
    # dequantised at load (fp8_block None): every divisible split is exact
    for tp in (2, 4):
        check_model_divisible(fp8, tp, None)
    # an FP8 tiny model whose experts align at TP 2 and 4 passes with sub-block dense slices (o_proj: 64 per rank)
    aligned = replace(fp8, moe_intermediate_size=512)
    for tp in (2, 4):
        check_model_divisible(aligned, tp, (128, 128))
    # DeepSeek-V3: TP 8 and 16 keep FP8; q_b_proj at TP 128 would straddle blocks (192 rows per rank)
    v3 = config("deepseek-v3")
    check_model_divisible(v3, 8, (128, 128))
    check_model_divisible(v3, 16, (128, 128))
    assert working_tp_sizes(v3, (128, 128)) == [1, 2, 4, 8, 16]
    msg = usage_error(check_model_divisible, replace(v3, moe_intermediate_size=2048 * 16), 128, (128, 128))
    assert "q_b_proj" in msg and "straddles" in msg and "192 per rank" in msg


def test_runtime_quantised_bf16_checkpoint_only_needs_whole_expert_blocks():
    v2 = config("deepseek-v2")  # bf16 checkpoint: --quantization fp8 quantises each rank's slice itself
    check_model_divisible(v2, 4, (128, 128))
    msg = usage_error(check_model_divisible, v2, 16, (128, 128))
    assert "1536 / 16 = 96" in msg and "drop --quantization fp8" in msg
