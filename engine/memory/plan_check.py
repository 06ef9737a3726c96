"""A memory plan's verdict: serve, serve with warnings, or refuse; each message with the fixes that would work.

Rules (the same for `dsctl serve --dry-run`, the launch check and the real start-up, which passes the pool
it allocated as `pool`):

- `--max-model-len` given and one request of that length does not fit a group's pool: refuse (this rule
  speaks first: the user chose that length; the fixes then also pass the next rule);
- a DP group's pool below `--min-kv-tokens`: refuse;
- `--max-model-len` not given and the pool is shorter than the model's context: the context limit becomes
  the pool (a warning);
- the pool holds fewer than `--max-running-requests` requests of `TYPICAL_REQUEST_TOKENS`: a warning;
- other processes hold at least `OTHERS_NOTED` of the GPU (a server still exiting, another job): every message
  says how much, freeing it is the first fix offered, and a plan that fits warns what it costs in KV tokens.

A fix is the plan re-run with one change (drop DP attention, an FP8 KV cache, INT4 experts, FP8 weights,
more GPUs; then pairs of them when no single one does it); it is named only when it would pass the rule,
with the KV tokens it gives. At real start-up those tokens are the real pool plus the plan's difference.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional

from engine.args import ModelArgs
from engine.distributed.divisibility import working_tp_sizes
from engine.memory.formats import FP8_BLOCK, quantization_for
from engine.memory.plan import GB, TYPICAL_REQUEST_TOKENS, MemoryPlan, replan

OTHERS_NOTED = 1 * GB  # memory other processes hold on a GPU that the messages name (below: noise)


@dataclass(frozen=True)
class Fix:
    flags: str  # what to change, as flags or words
    tokens: int  # KV tokens per DP group it gives


@dataclass
class Verdict:
    fits: bool
    context_limit: int
    pool: int  # KV tokens per DP group
    reason: str = ""  # why it is refused
    warnings: list[str] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)


def offered_quantizations() -> tuple[str, ...]:
    """The --quantization values this build accepts (a fix is only named when its flag exists)."""
    (f,) = [f for f in dataclasses.fields(ModelArgs) if f.name == "quantization"]
    return tuple(f.metadata.get("choices") or ())


def _candidates(plan: MemoryPlan) -> list[tuple[str, dict]]:
    """(flags, spec changes) of every single change that could give the KV pool more room."""
    s, cfg = plan.spec, plan.spec.cfg
    out = []
    if s.gpu_used_bytes >= OTHERS_NOTED:
        out.append((f"free the {s.gpu_used_bytes / GB:.1f} GB other processes hold on the GPU (a server still "
                    "exiting frees its memory within seconds)", {"gpu_used_bytes": 0.0}))
    if s.dp > 1:
        out.append(("drop --enable-dp-attention", {"dp": 1}))
    if s.kv_dtype_bytes > 1:
        out.append(("--kv-cache-dtype fp8_e4m3", {"kv_dtype_bytes": 1}))
    offered = offered_quantizations()
    if cfg.n_routed_experts and s.quant.name != "w4afp8" and "w4afp8" in offered:
        out.append(("--quantization w4afp8 (INT4 experts)", {"quant": quantization_for("w4afp8", s.quant.fp8_block)}))
    if s.quant.fp8_block is None and s.quant.name != "w4afp8" and "fp8" in offered:
        out.append(("--quantization fp8", {"quant": quantization_for("fp8", FP8_BLOCK.scale_block)}))
    bigger = [t for t in working_tp_sizes(cfg, s.quant.fp8_block, ep=s.ep > 1) if t > s.tp]
    if bigger:
        t = bigger[0]
        dp = s.dp * t // s.tp if s.dp > 1 else 1
        nodes = -(-t // s.gpus_per_node)
        flags = f"--tp {t}" + (f" --dp {dp}" if s.dp > 1 and s.dp != s.tp else "") + \
            (f" --nnodes {nodes}" if nodes > 1 else "") + f" ({t} GPUs)"
        out.append((flags, {"tp": t, "dp": dp, "ep": t if s.ep > 1 else 1}))
    return out


def _tokens(plan: MemoryPlan, fixed: MemoryPlan, pool: Optional[int]) -> int:
    """KV tokens per DP group under `fixed`: the plan's, or (given the real `pool`) the real one moved by the
    plan's difference (a real pool of 0 says only that nothing was left: the plan's shortfall stands for it)."""
    if pool is None:
        return fixed.memory_tokens
    real = pool * plan.kv_per_token if pool else min(0.0, plan.kv_bytes)
    real_bytes = real + (fixed.kv_bytes - plan.kv_bytes)
    return max(0, int(real_bytes // fixed.kv_per_token))


def fixes(plan: MemoryPlan, need: int, pool: Optional[int] = None) -> list[Fix]:
    """The changes (single ones, else pairs) after which a DP group's pool holds at least `need` tokens."""
    cands = _candidates(plan)
    for size in (1, 2):
        found = []
        for combo in itertools.combinations(cands, size):
            changes = {k: v for _, c in combo for k, v in c.items()}
            tokens = _tokens(plan, replan(plan, **changes), pool)
            if tokens >= need:
                found.append(Fix(" + ".join(f for f, _ in combo), tokens))
        if found:
            return found
    return []


def _advice(found: list[Fix], what: str) -> str:
    if not found:
        return "no flag change fits it on these GPUs: use GPUs with more memory"
    return f"fixes that give {what}: " + "; ".join(f"{f.flags}: {f.tokens:,} KV tokens per DP group" for f in found)


def _summary(plan: MemoryPlan, pool: int) -> str:
    s = plan.spec
    return (f"{s.model_name} at {s.layout_flags()} ({s.quant.name} weights, "
            f"{'fp8' if s.kv_dtype_bytes == 1 else 'bf16'} KV) on {s.gpu_bytes / GB:.0f} GB GPUs: "
            f"{plan.weight_bytes / GB:.1f} GB of weights per GPU, a KV pool of {pool:,} tokens per DP group"
            + (f", {s.gpu_used_bytes / GB:.1f} GB of the GPU held by other processes"
               if s.gpu_used_bytes >= OTHERS_NOTED else ""))


def _too_short(plan: MemoryPlan, v: Verdict, have: int, pool: Optional[int]) -> Verdict:
    """Refused: one request of --max-model-len does not fit a group's pool. The fixes: a shorter --max-model-len
    (only when the pool passes --min-kv-tokens), or the changes that give room for both rules."""
    s = plan.spec
    need = max(s.max_model_len, s.min_kv_tokens)
    room = fixes(plan, need, pool)
    v.fits, v.fixes = False, room
    head = f"{_summary(plan, have)}: one request of --max-model-len {s.max_model_len:,} tokens does not fit"
    if have >= s.min_kv_tokens:
        shorter = have // 1024 * 1024 or have
        v.fixes = [Fix(f"--max-model-len {shorter}", have)] + room
        v.reason = (f"{head}; give --max-model-len {shorter} or less, or "
                    + (_advice(room, f"room for {s.max_model_len:,}") if room else "use GPUs with more memory"))
    else:
        v.reason = (f"{head}, and the pool is below --min-kv-tokens {s.min_kv_tokens:,}: "
                    + _advice(room, f"room for {need:,}"))
    return v


def judge(plan: MemoryPlan, pool: Optional[int] = None) -> Verdict:
    """The plan's verdict; `pool`: the KV tokens per DP group the engine really allocated (real start-up)."""
    s = plan.spec
    have = plan.pool_tokens if pool is None else pool
    limit = min(s.model_context, have)
    v = Verdict(True, limit, have)
    if pool is None and s.max_total_tokens and s.max_total_tokens > plan.memory_tokens:
        v.fits = False
        v.reason = (f"{_summary(plan, have)}: --max-total-tokens {s.max_total_tokens:,} does not fit, the memory "
                    f"holds {plan.memory_tokens:,}; lower it or leave it out")
        return v
    if s.max_model_len and s.max_model_len > have:  # the length the user chose speaks first
        return _too_short(plan, v, have, pool)
    if have < s.min_kv_tokens:
        v.fits, v.fixes = False, fixes(plan, s.min_kv_tokens, pool)
        v.reason = (f"{_summary(plan, have)}, below --min-kv-tokens {s.min_kv_tokens:,}: "
                    f"{_advice(v.fixes, f'at least {s.min_kv_tokens:,}')}")
        return v
    if not s.max_model_len and have < s.cfg.max_position_embeddings:
        v.warnings.append(f"the context limit becomes {have:,} tokens, what a DP group's KV pool holds (the model "
                          f"allows {s.cfg.max_position_embeddings:,}); give --max-model-len to choose it")
    if s.gpu_used_bytes >= OTHERS_NOTED:
        idle = _tokens(plan, replan(plan, gpu_used_bytes=0.0), pool)
        v.warnings.append(f"other processes hold {s.gpu_used_bytes / GB:.1f} GB of the GPU: the KV pool is "
                          f"{idle - have:,} tokens per DP group smaller than on an idle GPU ({idle:,})")
    typical = min(TYPICAL_REQUEST_TOKENS, limit)
    if have < s.max_running_requests * typical:
        need = s.max_running_requests * typical
        more = fixes(plan, need, pool)
        v.warnings.append(
            f"a DP group's KV pool of {have:,} tokens holds {have // typical} requests of {typical:,} tokens at once, "
            f"fewer than --max-running-requests {s.max_running_requests}: more wait or are retracted; lower "
            f"--max-running-requests to {max(1, have // typical)}"
            + (f", or {_advice(more, f'{need:,}')}" if more else ""))
    return v
