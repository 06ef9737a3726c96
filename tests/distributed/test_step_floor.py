"""The decode step's bytes floor (engine/distributed/step_floor.py) against bytes counted by hand for the
built-in `tiny` config: weights and KV per rank, the TP split, DP attention keeping attention weights
whole on every rank of a group of one."""

import pytest

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed.step_floor import layer_bytes, step_bytes, step_floor_s

# tiny: hidden 256, 4 heads, q_lora 128, kv_lora 128, nope / rope / v 32, MLP 512, vocab 320;
# layer 0 dense, layers 1-3 MoE: 16 experts of 128, top 4, one shared expert, noaux_tc router bias
H, VOCAB = 256, 320
NORMS = 2 * H + 128 + 128  # input / post-attention norms, q_a and kv_a norms
REPL_ATTN = 128 * H + 160 * H  # q_a, kv_a (kv_lora + rope = 160)
SPLIT_ATTN = 4 * 64 * 128 + 4 * 64 * 128 + H * 4 * 32  # q_b, kv_b (nope + v), o_proj
DENSE_MLP = 3 * H * 512
EXPERT = 3 * H * 128
ROUTER = 16 * H  # float32 (the step reads 4 bytes each), + 16 float32 bias
KV_DIM = 160


@pytest.fixture(scope="module")
def cfg():
    return parse_config(lookup("tiny").config_dict())


def test_bf16_weights_and_kv_per_rank_by_hand(cfg):
    # bs 2 over tp 2: dense layer: replicated whole, attention and MLP halved; KV of both requests on every rank
    dense = layer_bytes(cfg, 0, bs=2, ctx=10, kv_bytes=2, weight_bytes=2, tp=2)
    assert dense == {"weights": 2 * (NORMS + REPL_ATTN + SPLIT_ATTN / 2 + DENSE_MLP / 2), "kv": 2 * 10 * KV_DIM * 2}
    # MoE layer: 2 tokens touch 16 (1 - (1 - 4/16)^2) = 7 experts in expectation, plus the shared one
    moe = layer_bytes(cfg, 1, bs=2, ctx=10, kv_bytes=1, weight_bytes=2, tp=2)
    routed_and_shared = (7 + 1) * EXPERT / 2
    assert moe["weights"] == pytest.approx(2 * (NORMS + REPL_ATTN + SPLIT_ATTN / 2 + routed_and_shared)
                                           + 4 * ROUTER + 16 * 4)
    assert moe["kv"] == 2 * 10 * KV_DIM * 1
    # the whole step: 4 layers, then lm_head (split), the final norm and 2 embedding rows (replicated)
    top = 2 * (VOCAB * H / 2 + H + 2 * H)
    assert step_bytes(cfg, 4, 2, 10, 2, 2, tp=2) == pytest.approx(
        dense["weights"] + 3 * moe["weights"] + 4 * dense["kv"] + top)
    assert step_floor_s(cfg, 4, 2, 10, 2, 1e9, 2, tp=2) == pytest.approx(step_bytes(cfg, 4, 2, 10, 2, 2, tp=2) / 1e9)


def test_dp_attention_keeps_attention_whole_and_reads_its_groups_kv(cfg):
    # tp 2 as 2 DP groups of one rank: attention (and lm_head) whole per rank, the MLP still split over both;
    # the busiest group runs ceil(3 / 2) = 2 of the 3 requests, so it reads 2 requests' cache
    dp = layer_bytes(cfg, 0, bs=3, ctx=10, kv_bytes=2, weight_bytes=2, tp=2, dp=2)
    assert dp == {"weights": 2 * (NORMS + REPL_ATTN + SPLIT_ATTN + DENSE_MLP / 2), "kv": 2 * 10 * KV_DIM * 2}
    tp = layer_bytes(cfg, 0, bs=3, ctx=10, kv_bytes=2, weight_bytes=2, tp=2)
    assert tp["kv"] == 3 * 10 * KV_DIM * 2
    top = 2 * (VOCAB * H + H + 2 * H)
    assert step_bytes(cfg, 1, 3, 10, 2, 2, tp=2, dp=2) == pytest.approx(sum(dp.values()) + top)


def test_fp8_linears_count_one_byte_plus_a_scale_per_block(cfg):
    def fp8(out_f, in_f):  # a block-FP8 weight: 1 byte each, a float32 per 128 x 128 block
        return out_f * in_f + -(-out_f // 128) * -(-in_f // 128) * 4

    linears = fp8(128, H) + fp8(160, H) + fp8(256, 128) * 2 + fp8(H, 128) + 2 * fp8(512, H) + fp8(H, 512)
    assert layer_bytes(cfg, 0, 1, 8, 2, weight_bytes=1)["weights"] == 2 * NORMS + linears


def test_an_other_kv_row_replaces_the_latent(cfg):
    # --disable-mla caches each local head's k and v: the runner passes its KV row
    assert layer_bytes(cfg, 0, 2, 10, 2, 2, kv_dim=4 * 96)["kv"] == 2 * 10 * 4 * 96 * 2


def test_int4_experts_count_half_a_byte_plus_a_scale_per_group(cfg):
    # W4AFP8 (cfg.experts_int4_group): a routed expert's w13 [256, H] and w2 [H, 128] at 4 bits, a float32
    # scale per 32 weights along K; the shared expert stays block-FP8 like the other linears
    from dataclasses import replace

    def fp8(out_f, in_f):
        return out_f * in_f + -(-out_f // 128) * -(-in_f // 128) * 4

    int4_expert = 256 * H / 2 + 256 * (H // 32) * 4 + H * 128 / 2 + H * (128 // 32) * 4
    fp8_expert = fp8(256, H) + fp8(H, 128)
    w4 = layer_bytes(replace(cfg, experts_int4_group=32), 1, bs=1, ctx=8, kv_bytes=2, weight_bytes=1)
    fp = layer_bytes(cfg, 1, bs=1, ctx=8, kv_bytes=2, weight_bytes=1)
    assert fp["weights"] - w4["weights"] == pytest.approx(4 * (fp8_expert - int4_expert))  # bs 1 touches top-4
