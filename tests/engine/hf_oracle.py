"""Random tiny DeepSeek checkpoints written by Hugging Face transformers (the independent oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

V3_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
V2_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
           "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=256,
              first_k_dense_replace=1, bos_token_id=0, eos_token_id=1)

VARIANTS = {
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, num_experts_per_tok=3, norm_topk_prob=True, rope_parameters=V3_ROPE)),
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=16.0, n_group=4,
        topk_group=2, num_experts_per_tok=3, topk_method="group_limited_greedy", norm_topk_prob=False,
        rope_parameters=V2_ROPE)),
    "v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.0, n_group=1,
        topk_group=1, num_experts_per_tok=3, topk_method="greedy", norm_topk_prob=False,
        rope_parameters=V2_ROPE)),
}


def make_checkpoint(variant: str, directory: Path, seed: int = 0, dtype=torch.bfloat16, **overrides) -> Path:
    """Save a random transformers model of the variant in HF layout (sharded) and return its dir.
    `overrides` replace COMMON sizes (e.g. an even vocab_size for tensor parallelism)."""
    import transformers

    cfg_name, model_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **overrides}, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    with torch.no_grad():  # make routing and biases non-trivial
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 4.0 / cfg.hidden_size ** 0.5)  # peaked next-token distributions
    model.to(dtype).save_pretrained(directory, max_shard_size="200KB")
    return directory


def hf_logprobs(directory: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """Teacher-forced log-probs [len-1] of ids[1:] under the transformers model."""
    model = load_hf(directory, dtype)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def load_hf(directory: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.float().eval() if dtype == torch.float32 else model.eval()


def hf_greedy(directory: Path, ids: list[int], n: int) -> list[int]:
    model = load_hf(directory)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
