"""The kernel shapes a model needs at a parallel layout, and the config file each one is tuned into.

Fused MoE (one shape per model / TP / EP / dtype):
  E = n_routed_experts / ep       experts on one rank
  N = moe_intermediate_size / (tp / ep)   the rank's shard of each expert's intermediate size
  K = hidden_size, top_k = num_experts_per_tok
EP ranks own whole experts (no split of N) and the remaining tp / ep factor splits N, so
tp 8 / ep 1 gives E=256, N=256 for DeepSeek-V3 and tp 8 / ep 8 gives E=32, N=2048.

Block-FP8 linear layers (one (N, K) GEMM each, out = x[M, K] @ W[N, K]^T), at tensor parallel tp:
  replicated       q_a_proj (hidden -> q_lora_rank) and kv_a_proj_with_mqa (hidden -> kv_lora + rope),
                   stacked into one qkv_a_proj GEMM (q_lora + kv_lora + rope: 2112 for V2/V3; MLA.merge_qkv_a)
                   when q_lora_rank is whole weight blocks: small outputs that every rank computes whole
  column-parallel  q_b_proj / q_proj, kv_b_proj (prefill only; decode uses the absorbed per-head
                   weights), dense-MLP and shared-expert gate_up (gate and up merged): N / tp
  row-parallel     o_proj, dense-MLP and shared-expert down_proj: K / tp (followed by an all-reduce)
Norms, embeddings, the router, the MTP eh_proj and lm_head are not FP8 and need no tuning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.checkpoint.config import ModelConfig, load_config, parse_config
from engine.checkpoint.registry import lookup
from engine.errors import UsageError
from kernels.fp8_math import WEIGHT_BLOCK
from kernels.int4 import INT4_GROUP
from kernels.tuned_configs import fp8_gemm_config_filename, moe_config_filename

MOE_DTYPES = ("fp8_w8a8", "bf16", "w4afp8")


@dataclass(frozen=True)
class Routing:
    """The router of the model (to draw realistic random expert choices)."""

    n_experts: int  # all routed experts (before EP)
    top_k: int
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MoEShape:
    E: int  # experts on this rank
    N: int  # per-rank intermediate size (w13 is [E, 2N, K], w2 [E, K, N])
    K: int  # hidden size
    top_k: int
    dtype: str  # fp8_w8a8 | bf16 | w4afp8
    block_shape: Optional[tuple[int, int]]  # FP8 weight-scale block, None for bf16 and w4afp8 (INT4 groups of 128)
    routing: Routing
    tp: int = 1
    ep: int = 1

    def filename(self, device: str) -> str:
        return moe_config_filename(self.E, self.N, device, self.dtype, self.block_shape)

    def describe(self) -> str:
        blk = f", block {list(self.block_shape)}" if self.block_shape else ""
        return f"E={self.E} N={self.N} K={self.K} top-{self.top_k} {self.dtype}{blk} (tp {self.tp}, ep {self.ep})"


@dataclass(frozen=True)
class GemmShape:
    N: int  # output features on this rank
    K: int  # input features on this rank
    layers: tuple[str, ...]  # the layers that run this GEMM
    block_shape: tuple[int, int] = (128, 128)

    def filename(self, device: str) -> str:
        return fp8_gemm_config_filename(self.N, self.K, device, self.block_shape)

    def describe(self) -> str:
        return f"N={self.N} K={self.K} ({', '.join(self.layers)})"


def load_model_config(model: str) -> ModelConfig:
    """--model: a registry alias (deepseek-v3, ...), a known hub repo id, or a checkpoint directory."""
    entry = lookup(model)
    if entry is not None:
        return parse_config(entry.config_dict())
    path = Path(model).expanduser()
    if path.is_dir():
        return load_config(path)
    if path.is_file() and path.name == "config.json":
        return load_config(path.parent)
    raise UsageError(f"--model {model!r} is neither a known alias (see `dsctl models`) nor a checkpoint directory")


def _split(value: int, parts: int, what: str, flag: str) -> int:
    if parts < 1:
        raise UsageError(f"{flag} must be >= 1")
    if value % parts:
        raise UsageError(f"{what} {value} does not split evenly over {flag} {parts}")
    return value // parts


def _check_block(value: int, block: int, what: str) -> None:
    if value % block:
        raise UsageError(f"{what} {value} is not a multiple of the {block}-wide FP8 weight block: "
                         "the checkpoint's block scales cannot be sharded that way (use a smaller --tp)")


def moe_shape(cfg: ModelConfig, tp: int = 1, ep: int = 1, dtype: Optional[str] = None) -> MoEShape:
    """Fused-MoE shape on one rank. dtype: fp8_w8a8 | bf16 | w4afp8 (INT4 experts, kernels/fused_moe_w4a8.py;
    its files have no block_shape part, like bf16's) (default: the checkpoint's)."""
    if not cfg.n_routed_experts:
        raise UsageError("this model has no routed experts: nothing for tune-moe to tune")
    if ep < 1 or tp < 1 or tp % ep:
        raise UsageError(f"--ep {ep} must be >= 1 and divide --tp {tp} (EP ranks are a subset of the TP ranks)")
    dtype = dtype or ("w4afp8" if cfg.experts_int4_group else "fp8_w8a8" if cfg.fp8 else "bf16")
    if dtype not in MOE_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(MOE_DTYPES)}")
    e = _split(cfg.n_routed_experts, ep, "n_routed_experts", "--ep")
    n = _split(cfg.moe_intermediate_size, tp // ep, "moe_intermediate_size", "--tp / --ep")
    block = None
    if dtype == "fp8_w8a8":
        block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else (128, 128)
        _check_block(n, block[0], "the per-rank moe_intermediate_size")
    if dtype == "w4afp8" and (cfg.hidden_size % INT4_GROUP or (n % INT4_GROUP and INT4_GROUP % n)):
        raise UsageError(f"--dtype w4afp8: hidden_size {cfg.hidden_size} and the per-rank moe_intermediate_size {n} "
                         f"must hold whole INT4 groups of {INT4_GROUP} (or n lie inside one)")
    routing = Routing(n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, method=cfg.topk_method,
                      n_group=cfg.n_group, topk_group=cfg.topk_group, scoring_func=cfg.scoring_func,
                      norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    return MoEShape(E=e, N=n, K=cfg.hidden_size, top_k=cfg.num_experts_per_tok, dtype=dtype, block_shape=block,
                    routing=routing, tp=tp, ep=ep)


def _linear_layers(cfg: ModelConfig, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of every FP8 linear layer on one rank."""
    h = _split(cfg.num_attention_heads, tp, "num_attention_heads", "--tp")
    hidden = cfg.hidden_size
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    block_n = cfg.fp8.block_n if cfg.fp8 else 128
    rows: list[tuple[str, int, int]] = []
    if cfg.q_lora_rank and cfg.q_lora_rank % block_n == 0:  # replicated, merged as MLA.merge_qkv_a does
        rows.append(("qkv_a_proj", cfg.q_lora_rank + kv_a, hidden))
    elif cfg.q_lora_rank:
        rows.append(("q_a_proj", cfg.q_lora_rank, hidden))
    if cfg.q_lora_rank:
        rows.append(("q_b_proj", h * cfg.qk_head_dim, cfg.q_lora_rank))  # column
    else:
        rows.append(("q_proj", h * cfg.qk_head_dim, hidden))  # column
    if not (cfg.q_lora_rank and cfg.q_lora_rank % block_n == 0):
        rows.append(("kv_a_proj_with_mqa", kv_a, hidden))  # replicated
    rows.append(("kv_b_proj", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))  # column
    rows.append(("o_proj", hidden, h * cfg.v_head_dim))  # row
    if cfg.first_k_dense_replace > 0 or not cfg.n_routed_experts:
        inter = _split(cfg.intermediate_size, tp, "intermediate_size", "--tp")
        rows.append(("mlp.gate_up_proj", 2 * inter, hidden))  # column (gate and up merged)
        rows.append(("mlp.down_proj", hidden, inter))  # row
    if cfg.n_routed_experts and cfg.n_shared_experts:
        inter = _split(cfg.n_shared_experts * cfg.moe_intermediate_size, tp, "shared-expert intermediate size",
                       "--tp")
        rows.append(("shared_experts.gate_up_proj", 2 * inter, hidden))
        rows.append(("shared_experts.down_proj", hidden, inter))
    return rows


def gemm_shapes(cfg: ModelConfig, tp: int = 1, layers: Optional[list[str]] = None) -> list[GemmShape]:
    """The distinct (N, K) block-FP8 GEMMs of the model at this TP, each with the layers that use it (for a bf16
    checkpoint, those `--quantization fp8` serves).

    `layers` keeps only shapes used by a layer whose name contains one of the strings."""
    # a bf16 checkpoint (V2, V2-Lite): the shapes `--quantization fp8` serves, in its 128 x 128 weight blocks
    block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else WEIGHT_BLOCK
    by_nk: dict[tuple[int, int], list[str]] = {}
    for name, n, k in _linear_layers(cfg, tp):
        if cfg.fp8:  # a checkpoint's scales shard along whole blocks; --quantization fp8 scales each rank's slice
            _check_block(k, block[1], f"{name}'s per-rank input size")
        by_nk.setdefault((n, k), []).append(name)
    shapes = [GemmShape(n, k, tuple(names), block) for (n, k), names in by_nk.items()]
    if layers:
        shapes = [s for s in shapes if any(w in name for w in layers for name in s.layers)]
        if not shapes:
            known = ", ".join(name for name, _, _ in _linear_layers(cfg, tp))
            raise UsageError(f"--layers {','.join(layers)} matches none of: {known}")
    return shapes


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def parse_batch_sizes(text: Optional[str], default=DEFAULT_BATCH_SIZES, flag: str = "--batch-sizes",
                      what: str = "batch sizes") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique); None -> the default list (SGLang's batch sizes). Other positive
    integer lists of a flag likewise (`flag` and `what` name them in the errors)."""
    if not text:
        return list(default)
    try:
        values = sorted({int(v) for v in text.replace(" ", "").split(",") if v})
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers such as 1,2,4,8") from None
    if not values or values[0] < 1:
        raise UsageError(f"{flag} {text!r}: {what} must be >= 1")
    return values
