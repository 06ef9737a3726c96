"""ModelConfig parsing: shipped configs, both rope spellings, FP8 config, clear errors."""


import pytest

from engine.checkpoint.config import load_config, parse_config
from engine.checkpoint.registry import MODELS, lookup
from engine.errors import ConfigError


def test_every_registry_config_parses():
    for entry in MODELS.values():
        cfg = parse_config(entry.config_dict())
        assert cfg.kv_cache_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_deepseek_v3_facts():
    cfg = parse_config(lookup("deepseek-v3").config_dict())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (7168, 61, 256, 8)
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob
    assert cfg.fp8 is not None and (cfg.fp8.block_n, cfg.fp8.block_k) == (128, 128)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    # yarn softmax scale: mscale(40, 1.0)^2 / sqrt(192)
    m = 0.1 * 1.0 * __import__("math").log(40) + 1
    assert cfg.softmax_scale == pytest.approx(m * m / 192**0.5)
    assert lookup("deepseek-ai/DeepSeek-R1").alias == "deepseek-r1"


def test_v2_lite_has_no_q_compression():
    cfg = parse_config(lookup("deepseek-v2-lite").config_dict())
    assert cfg.q_lora_rank is None and cfg.topk_method == "greedy" and not cfg.norm_topk_prob


def test_rope_parameters_and_rope_scaling_agree():
    raw = lookup("deepseek-v3").config_dict()
    old = parse_config(raw)
    new = dict(raw)
    params = dict(new.pop("rope_scaling"))
    params["rope_type"] = params.pop("type")
    params["rope_theta"] = new.pop("rope_theta")
    new["rope_parameters"] = params
    assert parse_config(new).rope == old.rope


@pytest.mark.parametrize("field", ["hidden_size", "kv_lora_rank", "vocab_size"])
def test_missing_field_is_named(field):
    raw = lookup("deepseek-v3").config_dict()
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture"):
        parse_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_unsupported_quantization():
    raw = lookup("deepseek-v3").config_dict()
    raw["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ConfigError, match="awq"):
        parse_config(raw)


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
