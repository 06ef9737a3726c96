"""`ModelConfig`: the shape and maths of a DeepSeek model, parsed from a HF config.json.

Supports DeepSeek-V2, V2-Lite (no q compression), V3 and R1; `rope_scaling` (old
transformers) or `rope_parameters` (new transformers); and the FP8
`quantization_config` of V3/R1. Anything unsupported raises `ConfigError` naming
the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from engine.errors import ConfigError

SUPPORTED_ARCHS = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}

REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
)
MOE_REQUIRED = ("moe_intermediate_size", "num_experts_per_tok")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class Fp8Config:
    block_n: int = 128
    block_k: int = 128
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # deepseek_v3 | deepseek_v2
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rope: RopeConfig
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    # MoE (n_routed_experts == 0 means a dense model)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"  # noaux_tc | group_limited_greedy | greedy
    scoring_func: str = "softmax"  # sigmoid | softmax
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    fp8: Optional[Fp8Config] = None
    # W4AFP8: routed experts stored as INT4 (K groups of this many, one scale each) with FP8 activations,
    # the other linears block FP8 (a `w4afp8` checkpoint, or --quantization w4afp8); None: experts like the rest
    experts_int4_group: Optional[int] = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived ----------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.kind == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def with_num_layers(self, n: int) -> "ModelConfig":
        return replace(self, num_hidden_layers=n)

    def with_int4_experts(self, group: int = 128) -> "ModelConfig":
        """This model with W4AFP8 routed experts (a checkpoint's own group size is kept)."""
        return replace(self, experts_int4_group=self.experts_int4_group or group)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(cfg: dict) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (DeepSeek models use 'yarn')")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise ConfigError(f"config.json: rope_scaling is 'yarn' but has no {key!r}")
    return RopeConfig(
        theta=float(theta),
        kind="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _parse_fp8(cfg: dict) -> Optional[Fp8Config]:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in ("fp8", "w4afp8"):
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(supported: 'fp8' with weight_block_size [128, 128], and 'w4afp8')"
        )
    block = q.get("weight_block_size") or ([128, 128] if method == "w4afp8" else None)
    if not block or len(block) != 2:
        raise ConfigError("config.json: FP8 quantization_config needs weight_block_size [N, K] (block-wise FP8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config.json: FP8 format {fmt!r} is not supported (only e4m3)")
    return Fp8Config(block_n=int(block[0]), block_k=int(block[1]), fmt=fmt,
                     activation_scheme=q.get("activation_scheme", "dynamic"))


def _int4_group(cfg: dict) -> Optional[int]:
    """The INT4 expert group of a W4AFP8 checkpoint (SGLang's `w4afp8` method: 128 unless given)."""
    q = cfg.get("quantization_config") or {}
    return int(q.get("group_size") or 128) if q.get("quant_method") == "w4afp8" else None


def _eos(cfg: dict) -> Optional[int]:
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos


def parse_config(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a config.json dict; ConfigError on anything unsupported."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known = [SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS]
    if known:
        model_type = known[0]
    elif model_type not in SUPPORTED_ARCHS.values():
        raise ConfigError(
            f"unsupported architecture {archs or model_type!r}: dsctl serves "
            f"{', '.join(SUPPORTED_ARCHS)} (DeepSeek-V2, V2-Lite, V3, R1)"
        )
    missing = [k for k in REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
    v3 = model_type == "deepseek_v3"
    n_experts = cfg.get("n_routed_experts") or 0
    if n_experts:
        missing = [k for k in MOE_REQUIRED if cfg.get(k) is None]
        if missing:
            raise ConfigError(f"config.json has n_routed_experts but is missing: {', '.join(missing)}")
    topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if topk_method not in ("noaux_tc", "group_limited_greedy", "greedy"):
        raise ConfigError(f"config.json: topk_method {topk_method!r} is not supported")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"config.json: scoring_func {scoring!r} is not supported")
    n_group = cfg.get("n_group") or 1
    if n_experts and n_experts % n_group:
        raise ConfigError(f"config.json: n_routed_experts {n_experts} is not divisible by n_group {n_group}")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"config.json: num_key_value_heads {kv_heads} != num_attention_heads {heads} "
                          "(MLA needs equal)")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=int(heads),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        intermediate_size=int(cfg["intermediate_size"]),
        rope=_parse_rope(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        n_routed_experts=int(n_experts),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
        n_group=int(n_group),
        topk_group=int(cfg.get("topk_group") or 1),
        topk_method=topk_method,
        scoring_func=scoring,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_eos(cfg),
        fp8=_parse_fp8(cfg),
        experts_int4_group=_int4_group(cfg),
        raw=cfg,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json (is it a Hugging Face checkpoint directory?)")
    try:
        cfg: Any = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return parse_config(cfg)
