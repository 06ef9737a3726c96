"""Per-rank weight bytes and KV tokens (engine/distributed/sizing.py) against the real model's parameters.

Acceptance point 5: the parameter bytes one rank holds at TP N — the model's own parameters
(built on the meta device) cut with engine/weights/sharding.py's specs — are within 5% of
sizing's replicated + split / N (and equal to sizing's total at TP 1).
"""

from dataclasses import replace

import pytest
import torch

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.distributed import sizing
from engine.distributed.sizing import GIB, Layout, check_fits, kv_bytes_per_token, plan_memory, weight_bytes
from engine.errors import UsageError
from engine.weights.sharding import is_scale, local_shape, weight_name

BLOCK = (128, 128)


def config(alias):
    return parse_config(lookup(alias).config_dict())


def model_params(cfg, fp8_block, dtype=torch.bfloat16):
    """{name: (shape, itemsize)} of the engine's model + MTP layer, and the absorbed-buffer bytes."""
    from engine.model.deepseek import DeepseekForCausalLM, MTPLayer

    with torch.device("meta"):
        modules = {"": DeepseekForCausalLM(cfg, dtype, fp8_block)}
        if cfg.num_nextn_predict_layers:
            modules["mtp."] = MTPLayer(cfg, cfg.num_hidden_layers, dtype, fp8_block,
                                       moe=cfg.is_moe_layer(cfg.num_hidden_layers))
    params = {p + n: (tuple(t.shape), t.element_size()) for p, m in modules.items() for n, t in m.named_parameters()}
    absorbed = sum(b.numel() * b.element_size() for m in modules.values() for n, b in m.named_buffers()
                   if n.endswith(("w_kc", "w_vc")))
    return params, absorbed


def rank_bytes(params, tp, rank, fp8_block):
    total = 0
    for name, (shape, itemsize) in params.items():
        wshape = params[weight_name(name)][0] if is_scale(name) else None
        local = local_shape(name, shape, tp, fp8_block, wshape, tp_rank=rank)
        total += itemsize * torch.Size(local).numel()
    return total


@pytest.mark.parametrize("alias, fp8_block, tps", [
    ("tiny", None, (1, 2, 4)),
    ("tiny-fp8-aligned", BLOCK, (1, 2, 4)),
    ("deepseek-v3", BLOCK, (1, 8, 16)),
    ("deepseek-v2-lite", None, (1, 2, 16)),
])
def test_per_rank_parameter_bytes_match_the_sharded_model(alias, fp8_block, tps):
    cfg = replace(config("tiny-fp8"), moe_intermediate_size=512) if alias == "tiny-fp8-aligned" else config(alias)
    params, absorbed = model_params(cfg, fp8_block)
    for tp in tps:
        w = weight_bytes(cfg, tp, 2, fp8_block)
        if tp == 1:  # the analytic count is exact for the whole model
            assert sum(s.numel() * i for s, i in ((torch.Size(s), i) for s, i in params.values())) \
                == w.replicated + w.split + w.attention
            assert absorbed == w.absorbed
            continue
        for rank in sorted({0, tp - 1}):
            got = rank_bytes(params, tp, rank, fp8_block)
            assert abs(got - w.params_per_rank()) <= 0.05 * got, (alias, tp, rank, got, w.params_per_rank())
        # and the split parts really are most of the model, so the check has teeth
        assert w.split + w.attention > 5 * w.replicated


def test_kv_bytes_and_tokens_per_rank():
    v3 = config("deepseek-v3")
    assert kv_bytes_per_token(v3, 2) == (61 + 1) * (512 + 64) * 2
    assert kv_bytes_per_token(v3, 1, include_mtp=False) == 61 * 576
    layout = Layout(tp_size=8, gpu_bytes=141 * GIB, mem_fraction_static=0.85, fp8_block=BLOCK)
    plan = plan_memory(v3, layout)
    left = 141 * GIB * 0.85 - plan.weights_per_rank
    assert plan.kv_tokens * plan.kv_per_token <= left < (plan.kv_tokens + 1) * plan.kv_per_token
    # the latent is not split by TP: doubling TP frees weight memory but keeps bytes per token
    plan16 = plan_memory(v3, replace(layout, tp_size=16))
    assert plan16.kv_per_token == plan.kv_per_token and plan16.kv_tokens > plan.kv_tokens
    # DP attention's extension point: attention split over fewer ranks costs memory
    assert plan_memory(v3, replace(layout, attn_tp_size=1)).weights_per_rank > plan.weights_per_rank


@pytest.mark.parametrize("alias, fp8_block, tp, dp, ep", [
    ("deepseek-v3", BLOCK, 8, 8, 1), ("deepseek-v3", BLOCK, 8, 2, 8), ("deepseek-v3", BLOCK, 8, 1, 8),
    ("tiny", None, 4, 2, 4),
])
def test_dp_attention_and_ep_bytes_match_the_sharded_model(alias, fp8_block, tp, dp, ep):
    """Sizing's bytes per rank under DP attention (attention and vocab over tp / dp ranks) and EP (whole
    experts) against the real model's parameters cut by the same group's specs."""
    from engine.model.builder import make_modules
    from engine.weights.loader import iter_params
    from tests.distributed.test_model_ep import _group

    cfg = config(alias).with_num_layers(5) if alias == "deepseek-v3" else config(alias)
    w = weight_bytes(cfg, tp, 2, fp8_block, include_mtp=False, attn_tp_size=tp // dp)
    for rank in (0, tp - 1):
        with torch.device("meta"):
            mods = make_modules(cfg, cfg.num_hidden_layers, torch.bfloat16, fp8_block, _group(rank, tp, ep, dp),
                                mtp=False)
        got = sum(p.numel() * p.element_size() for _, p in iter_params(mods))
        assert abs(got - w.params_per_rank()) <= 0.01 * got, (alias, tp, dp, ep, rank, got, w.params_per_rank())


def test_dp_attention_job_holds_dp_pools():
    """Acceptance 3: each DP group has its own pool, so the job's KV tokens are dp x a GPU's; plain TP holds
    one (duplicated) copy. A DP-attention GPU holds more attention weights, so slightly fewer tokens per GPU."""
    v3 = config("deepseek-v3")
    tp8 = plan_memory(v3, Layout(tp_size=8, gpu_bytes=141 * GIB, fp8_block=BLOCK))
    dp8 = plan_memory(v3, Layout(tp_size=8, gpu_bytes=141 * GIB, fp8_block=BLOCK, attn_tp_size=1))
    ep8 = plan_memory(v3, Layout(tp_size=8, gpu_bytes=141 * GIB, fp8_block=BLOCK, ep_size=8))
    assert tp8.job_kv_tokens == tp8.kv_tokens and dp8.job_kv_tokens == 8 * dp8.kv_tokens
    assert 0.5 * tp8.kv_tokens < dp8.kv_tokens < tp8.kv_tokens
    assert dp8.job_kv_tokens > 4 * tp8.job_kv_tokens
    assert ep8.kv_tokens == tp8.kv_tokens


def test_fail_fast_says_what_it_needs_and_what_fits():
    v3 = config("deepseek-v3")
    h100 = Layout(tp_size=8, gpu_bytes=80 * GIB, fp8_block=BLOCK)
    with pytest.raises(UsageError) as exc:
        check_fits(v3, h100, name="deepseek-v3")
    msg = str(exc.value)
    assert "\n" not in msg and "deepseek-v3 needs" in msg and "GiB of weights per GPU at --tp 8" in msg
    assert "--tp 16 --nnodes 2" in msg
    check_fits(v3, replace(h100, tp_size=16))  # the suggestion does fit
    check_fits(v3, replace(h100, gpu_bytes=141 * GIB))

    v2 = config("deepseek-v2")  # bf16 checkpoint, 236B: too big for 4 x 80 GB in bf16
    small = Layout(tp_size=4, gpu_bytes=80 * GIB)
    with pytest.raises(UsageError) as exc:
        check_fits(v2, small)
    assert "--quantization fp8" in str(exc.value)
    check_fits(v2, replace(small, fp8_block=BLOCK))

    with pytest.raises(UsageError, match="use GPUs with more memory"):
        check_fits(v3, Layout(tp_size=8, gpu_bytes=4 * GIB, fp8_block=BLOCK))


def test_table_command(capsys):
    sizing.main(["--table"])
    out = capsys.readouterr().out
    assert "TP 8 on 8 x H200 (141 GB)" in out and "TP 16 on 2 x 8 x H100 (80 GB)" in out
    assert "does not fit (try --tp 16 --nnodes 2)" in out
    assert "TP 8 + DP attention 8 on 8 x H200" in out and "TP 8 + EP 8 on 8 x H200" in out
