"""The memory plan: what one GPU of a layout holds, computed from the config and the flags before any weight is read.

Per rank, inside `--mem-fraction-static` of the card (minus what other processes already use):

- weights by part (`weight_parts`): embedding + lm_head (vocab rows over the attention group), attention
  (q_a / kv_a and their norms whole on every rank, q_b / kv_b / o_proj and the absorbed w_kc / w_vc over the
  attention group: DP attention replicates them over its groups), routed experts (over TP, or whole
  experts over EP: the same bytes; an --expert-placement's redundant copies added), shared experts + dense MLP (over TP), norms + router (whole), the MTP
  layer (when the checkpoint ships it: the engine builds it whether or not it speculates). Linear layers
  and routed experts are stored as the `--quantization` scheme says (engine/memory/formats.py); the
  rest in the model dtype.
- the start-up reserve, in use when the runner sizes the KV pool besides the weights (`reserve_bytes`):
  the CUDA context, kernel workspaces and the caching allocator's slack from loading, NCCL communicators
  with more than one rank, DP attention's buffers (measured constants), and the request table (exact);
- the KV pool: what is left, in tokens of `kv_per_token` bytes (every cache layer's latent, or with
  --disable-mla this rank's expanded heads), by `kv_pool_tokens`, the rule the runner sizes its pool with
  (engine/runner/model_runner.py). Each DP group has its own pool; the ranks of a group hold the same
  token slots.

Outside the fraction: activations, CUDA graphs and what the runner allocates after the pool (the rope tables,
speculative decoding's request-table scratch rows), `(1 - --mem-fraction-static)` of the card.
engine/memory/plan_check.py turns a plan into a verdict: refusals, warnings, fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from engine.args import EngineArgs
from engine.checkpoint.config import ModelConfig
from engine.distributed.expert_placement import load_placement
from engine.memory.formats import QUANTIZATIONS, Quantization, quantization_for
from engine.memory.weight_tally import ATTN, REPL, SPLIT, Tally

GB = 1e9  # the unit of the engine's start-up log line ("weights 67.60 GB") and of --gpu-memory-gb
# What a rank holds when its KV pool is sized besides the weights and the request table, measured on H100 80GB as
# the budget less the weights, the request table and the pool the rank allocated (FP8 dummy weights):
# one GPU 1.82 GB (DeepSeek-V3 --num-layers 3), --tp 4 2.23 GB, --tp 4 --enable-dp-attention 2.40 GB (DeepSeek-V2).
ONE_GPU_RESERVE_BYTES = 1.82e9  # CUDA context (~0.56 GB), kernel workspaces, the allocator's slack from loading
NCCL_RESERVE_BYTES = 0.41e9  # NCCL communicators and their buffers, with more than one rank
DP_ATTENTION_RESERVE_BYTES = 0.17e9  # DP attention's gather buffers and its extra communicators
# What a process that has only asked CUDA for free memory (`torch.cuda.mem_get_info`) holds itself: measured on
# H100 80GB as `dsctl serve --dry-run`'s pool shortfall at --tp 4 (8,166 tokens of 69,120 bytes).
CUDA_CONTEXT_BYTES = 0.56e9
TYPICAL_REQUEST_TOKENS = 2048  # "a typical request" of the concurrency warning: 1024 in + 1024 out

EMBED, ATTENTION, EXPERTS, DENSE, SMALL, MTP = (
    "embedding + lm_head", "attention + w_kc / w_vc", "routed experts", "shared experts + dense MLP",
    "norms + router", "MTP layer")


@dataclass(frozen=True)
class PlanSpec:
    """Everything a plan depends on (flag values and the card), no torch."""

    cfg: ModelConfig  # with --num-layers applied
    model_name: str = "the model"
    tp: int = 1
    dp: int = 1  # DP attention groups (1: plain attention)
    ep: int = 1
    a2a: bool = False  # --moe-a2a-backend other than none: the shared experts are whole on every rank
    gpus_per_node: int = 8
    quant: Quantization = field(default_factory=lambda: QUANTIZATIONS["fp8"])
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    mtp: bool = True  # the MTP layer is built (its weights and one more cache layer)
    expanded_kv: bool = False  # --disable-mla
    gpu_bytes: float = 80 * GB  # one card's total memory (torch.cuda.mem_get_info's total: 85.0 GB on an H100 80GB)
    gpu_used_bytes: float = 0.0  # in use by other processes before start-up (`used_by_others`)
    mem_fraction_static: float = 0.85
    max_model_len: Optional[int] = None  # --max-model-len, when given
    max_total_tokens: Optional[int] = None  # --max-total-tokens, when given
    max_running_requests: int = 256
    min_kv_tokens: int = 4096
    redundant_experts: int = 0  # --expert-placement: extra expert slots per MoE layer (the most of any layer)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def model_context(self) -> int:
        """The context the flags ask for: --max-model-len, else the model's max_position_embeddings."""
        return min(self.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)

    def layout_flags(self) -> str:
        """The layout as flags, e.g. "--tp 4 --enable-dp-attention --dp 4"."""
        out = f"--tp {self.tp}"
        if self.dp > 1:
            out += " --enable-dp-attention" + (f" --dp {self.dp}" if self.dp != self.tp else "")
        if self.ep > 1:
            out += " --enable-ep-moe"
        return out


class _Parts:
    """Bytes per part, kept as (replicated, split over TP, split over the attention group)."""

    def __init__(self) -> None:
        self.bytes: dict[str, list[float]] = {}

    def add(self, part: str, t: Tally, absorbed: bool = True) -> None:
        row = self.bytes.setdefault(part, [0.0, 0.0, 0.0])
        row[0] += t.bytes[REPL]
        row[1] += t.bytes[SPLIT]
        row[2] += t.bytes[ATTN] + (t.absorbed if absorbed else 0)

    def per_rank(self, tp: int, attn_tp: int) -> dict[str, float]:
        return {p: r + s / tp + a / attn_tp for p, (r, s, a) in self.bytes.items()}


def _layer(parts: _Parts, cfg: ModelConfig, spec: PlanSpec, moe: bool, into: Optional[str] = None) -> None:
    """One decoder layer into its parts (or all into `into`, for the MTP layer)."""
    db = spec.dtype_bytes
    attn, small, mlp, experts = (Tally(db, spec.quant.fp8_block) for _ in range(4))
    small.dense(2 * cfg.hidden_size, REPL)  # input / post-attention norms
    attn.attention(cfg)  # with the absorbed w_kc / w_vc
    if not moe:
        mlp.mlp(cfg.hidden_size, cfg.intermediate_size)
    else:
        h, e, n = cfg.hidden_size, cfg.n_routed_experts + spec.redundant_experts, cfg.moe_intermediate_size
        small.router(cfg)
        fmt = spec.quant.experts
        experts.add(e * (fmt.nbytes(2 * n, h, db) + fmt.nbytes(h, n, db)), SPLIT)  # w13, w2 (EP: whole ones)
        mlp.shared_experts(cfg, REPL if spec.a2a else SPLIT)
    for part, t in ((ATTENTION, attn), (SMALL, small), (DENSE, mlp), (EXPERTS, experts)):
        parts.add(into or part, t)


def weight_parts(spec: PlanSpec) -> dict[str, float]:
    """One rank's weight bytes by part (absorbed buffers included; the MTP layer shares embed / lm_head)."""
    cfg, db = spec.cfg, spec.dtype_bytes
    parts = _Parts()
    head = Tally(db, None)
    head.dense(cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2), ATTN)
    parts.add(EMBED, head)
    final = Tally(db, None)
    final.dense(cfg.hidden_size, REPL)
    parts.add(SMALL, final)
    for i in range(cfg.num_hidden_layers):
        _layer(parts, cfg, spec, cfg.is_moe_layer(i))
    if spec.mtp and cfg.num_nextn_predict_layers:
        mtp = Tally(db, None)
        mtp.dense(3 * cfg.hidden_size, REPL)  # enorm, hnorm, shared_head norm
        mtp.linear(cfg.hidden_size, 2 * cfg.hidden_size, REPL, fp8=False)  # eh_proj (model dtype)
        parts.add(MTP, mtp)
        _layer(parts, cfg, spec, cfg.is_moe_layer(cfg.num_hidden_layers), into=MTP)
    return parts.per_rank(spec.tp, spec.attn_tp)


def kv_per_token(spec: PlanSpec) -> int:
    """KV bytes one token takes on each rank of its DP group (every cache layer)."""
    cfg = spec.cfg
    layers = cfg.num_hidden_layers + (1 if spec.mtp and cfg.num_nextn_predict_layers else 0)
    row = (cfg.num_attention_heads // spec.attn_tp) * (cfg.qk_head_dim + cfg.v_head_dim) if spec.expanded_kv \
        else cfg.kv_cache_dim
    return layers * row * spec.kv_dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory under `spec`, in bytes; the KV pool in tokens per DP group."""

    spec: PlanSpec
    weights: dict[str, float]  # per part
    reserve: dict[str, float]  # before the KV pool, inside the budget
    kv_per_token: int

    @property
    def budget(self) -> float:
        """--mem-fraction-static of the card, less what other processes use."""
        return self.spec.gpu_bytes * self.spec.mem_fraction_static - self.spec.gpu_used_bytes

    @property
    def outside(self) -> float:
        """Left for activations and CUDA graphs: the card's memory outside the fraction."""
        return self.spec.gpu_bytes * (1 - self.spec.mem_fraction_static)

    @property
    def weight_bytes(self) -> float:
        return sum(self.weights.values())

    @property
    def kv_bytes(self) -> float:
        """What the budget leaves for the KV pool (negative: the weights alone do not fit)."""
        return self.budget - self.weight_bytes - sum(self.reserve.values())

    @property
    def memory_tokens(self) -> int:
        """KV tokens the memory holds: the runner's rule, with what it would find in use."""
        used = self.spec.gpu_used_bytes + self.weight_bytes + sum(self.reserve.values())
        return kv_pool_tokens(self.spec.gpu_bytes, used, self.spec.mem_fraction_static, self.kv_per_token)

    @property
    def pool_tokens(self) -> int:
        """The pool the engine would allocate per DP group: --max-total-tokens, else what memory holds."""
        return self.spec.max_total_tokens or self.memory_tokens

    @property
    def job_tokens(self) -> int:
        return self.pool_tokens * self.spec.dp

    @property
    def context_limit(self) -> int:
        """The context limit the engine would serve with: --max-model-len / the model's, capped by the pool."""
        return min(self.spec.model_context, self.pool_tokens)

    def requests_of(self, tokens: int) -> int:
        """Requests of `tokens` tokens a DP group's pool holds at once."""
        return self.pool_tokens // max(1, tokens)


def kv_pool_tokens(total: float, used: float, mem_fraction_static: float, per_token: int) -> int:
    """The KV pool's size rule, the plan's and the runner's: the tokens of `per_token` bytes that fit in
    --mem-fraction-static of the card's `total` memory (torch.cuda.mem_get_info's total) less all that is `used`
    on it when the pool is sized (other processes, this rank's CUDA context and NCCL, the weights, the request
    table); 0 when nothing is left."""
    return max(0, int((total * mem_fraction_static - used) // per_token))


def used_by_others(total: float, free: float, communicators: bool = False, dp_attention: bool = False) -> float:
    """What other processes use, from `torch.cuda.mem_get_info` asked by a process holding no tensors (its own
    CUDA context is in the start-up reserve, not in `gpu_used_bytes`). `communicators`: the process has joined a
    group of ranks over NCCL (their communicators are set up when it joins, and are in the reserve too:
    NCCL_RESERVE_BYTES, and DP_ATTENTION_RESERVE_BYTES with `dp_attention`). An estimate: the reserves are the
    plan's measured constants, not this process's bytes (DP attention's gather buffers come later, so others'
    use may read up to 0.17 GB low)."""
    own = CUDA_CONTEXT_BYTES + (NCCL_RESERVE_BYTES if communicators else 0.0)
    own += DP_ATTENTION_RESERVE_BYTES if communicators and dp_attention else 0.0
    return max(0.0, total - free - own)


def reserve_bytes(spec: PlanSpec) -> dict[str, float]:
    """What a rank holds besides the weights when its KV pool is sized, by item."""
    out = {"CUDA context, slack (measured)": ONE_GPU_RESERVE_BYTES}
    if spec.tp > 1:
        out["NCCL (measured)"] = NCCL_RESERVE_BYTES
    if spec.dp > 1:
        out["DP attention (measured)"] = DP_ATTENTION_RESERVE_BYTES
    out["request table"] = (spec.max_running_requests + 1) * (spec.model_context + 1) * 4  # + the padding row
    return out


def plan_memory(spec: PlanSpec) -> MemoryPlan:
    return MemoryPlan(spec, weight_parts(spec), reserve_bytes(spec), kv_per_token(spec))


def replan(plan: MemoryPlan, **changes) -> MemoryPlan:
    """The plan with some of its spec changed (a fix: another layout, dtype, quantisation)."""
    return plan_memory(replace(plan.spec, **changes))


def quantization_name(requested: Optional[str], fp8_block: Optional[tuple[int, int]], cfg: ModelConfig) -> str:
    """The formats table's scheme for --quantization `requested`, linear weights kept FP8 in `fp8_block` (None:
    model dtype), and the checkpoint's own INT4 experts."""
    if requested == "w4afp8" or cfg.experts_int4_group:
        return "w4afp8"
    return "fp8" if fp8_block else "bf16"


def spec_from_args(args: EngineArgs, cfg: ModelConfig, *, tp: int, dp: int, ep: int,
                   fp8_block: Optional[tuple[int, int]], mtp: bool, gpu_bytes: float, gpu_used_bytes: float = 0.0,
                   gpus_per_node: int = 8) -> PlanSpec:
    """A plan's input from the flags, the (--num-layers) config and what the launcher or the runner knows: the
    layout (`dp`: DP attention groups), the FP8 block kept on the GPU, whether the MTP layer is built, the card."""
    return PlanSpec(
        cfg, args.model.model, tp=tp, dp=dp, ep=ep, a2a=args.parallel.moe_a2a_backend != "none",
        gpus_per_node=gpus_per_node,
        quant=quantization_for(quantization_name(args.model.quantization, fp8_block, cfg), fp8_block,
                               cfg.experts_int4_group or 128),
        dtype_bytes=4 if args.model.dtype == "float32" else 2,
        kv_dtype_bytes=1 if args.cache.kv_cache_dtype != "auto" else 2, mtp=mtp,
        expanded_kv=args.kernels.disable_mla, gpu_bytes=gpu_bytes, gpu_used_bytes=gpu_used_bytes,
        mem_fraction_static=args.cache.mem_fraction_static, max_model_len=args.model.max_model_len,
        max_total_tokens=args.cache.max_total_tokens, max_running_requests=args.scheduler.max_running_requests,
        min_kv_tokens=args.cache.min_kv_tokens,
        redundant_experts=load_placement(args.parallel.expert_placement).redundant()
        if args.parallel.expert_placement else 0)
