"""The memory plan on screen: `dsctl serve --dry-run`'s table (one GPU of the layout) and its verdict.

The numbers come from engine/memory/plan.py (per rank, GB = 10^9 bytes, as the engine's start-up line logs
them); the rules and fixes from engine/memory/plan_check.py. `dry_run` exits 0 when the plan fits and raises
the refusal (exit 2) when it does not.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from engine.args import EngineArgs
from engine.errors import UsageError
from engine.memory.plan import ATTENTION, DENSE, EMBED, EXPERTS, GB, MTP, SMALL, TYPICAL_REQUEST_TOKENS, MemoryPlan
from engine.memory.plan_check import Verdict


def _part_note(plan: MemoryPlan, part: str) -> str:
    s, cfg = plan.spec, plan.spec.cfg
    split = f"split over the {s.attn_tp}-rank attention group" if s.attn_tp > 1 else "whole on every rank"
    notes = {
        EMBED: f"vocab rows {split}",
        ATTENTION: f"q_b / kv_b / o_proj {split}; q_a / kv_a whole"
                   + (f"; DP attention replicates it in each of {s.dp} groups" if s.dp > 1 else ""),
        EXPERTS: (f"{cfg.n_routed_experts // max(1, s.ep)} whole experts per rank (EP {s.ep})" if s.ep > 1
                  else f"each expert split over {s.tp} ranks") + f"; {s.quant.name}",
        DENSE: f"split over {s.tp} ranks" + ("; shared experts whole (all-to-all EP)" if s.a2a else ""),
        SMALL: "whole on every rank",
        MTP: "the NextN layer the checkpoint ships (built whether or not it speculates)",
    }
    return notes.get(part, "")


def plan_table(plan: MemoryPlan) -> Table:
    s = plan.spec
    title = (f"Memory plan per GPU: {s.model_name} {s.layout_flags()}, {s.quant.name} weights, "
             f"{'fp8' if s.kv_dtype_bytes == 1 else 'bf16'} KV, {s.gpu_bytes / GB:.1f} GB GPU")
    t = Table(title=title)
    t.add_column("what", no_wrap=True)
    t.add_column("GB", justify="right", no_wrap=True)
    t.add_column("notes")
    t.add_row("GPU memory", f"{s.gpu_bytes / GB:.2f}", "")
    if s.gpu_used_bytes:
        t.add_row("in use by other processes", f"{s.gpu_used_bytes / GB:.2f}", "")
    t.add_row(f"--mem-fraction-static {s.mem_fraction_static}", f"{plan.budget / GB:.2f}",
              "weights + start-up reserve + KV pool")
    for part, nbytes in plan.weights.items():
        t.add_row(f"  {part}", f"{nbytes / GB:.2f}", _part_note(plan, part))
    t.add_row("weights", f"{plan.weight_bytes / GB:.2f}", "the engine logs this less the absorbed w_kc / w_vc")
    for part, nbytes in plan.reserve.items():
        t.add_row(f"  {part}", f"{nbytes / GB:.2f}", "")
    t.add_row("KV pool", f"{plan.kv_bytes / GB:.2f}",  # negative: the weights alone do not fit
              f"{plan.pool_tokens:,} tokens per DP group x {s.dp} group(s) = {plan.job_tokens:,}; "
              f"{plan.kv_per_token:,} bytes per token")
    t.add_row("activations + CUDA graphs", f"{plan.outside / GB:.2f}", "outside --mem-fraction-static")
    return t


def verdict_lines(plan: MemoryPlan, v: Verdict) -> list[str]:
    s = plan.spec
    context = s.model_context
    typical = min(TYPICAL_REQUEST_TOKENS, v.context_limit or 1)
    lines = [f"KV pool: {v.pool:,} tokens per DP group: {v.pool // context:,} request(s) of the full "
             f"{context:,}-token context, {v.pool // typical:,} of {typical:,} tokens; context limit "
             f"{v.context_limit:,} tokens"]
    lines += [f"warning: {w}" for w in v.warnings]
    lines.append("fits" if v.fits else "does not fit")
    return lines


def dry_run(args: EngineArgs) -> None:
    """Print the plan and its verdict; raise the refusal (exit 2) when it does not fit."""
    from engine.runtime.launch_checks import dry_run_plan  # lazy: imports torch; keeps dsctl --help fast

    plan, verdict = dry_run_plan(args)
    console = Console()
    console.print(plan_table(plan))
    for line in verdict_lines(plan, verdict):
        console.print(line, markup=False, highlight=False)
    if not verdict.fits:
        raise UsageError(verdict.reason)
