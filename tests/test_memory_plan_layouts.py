"""The memory plan (engine/memory/plan.py) on full-size layouts: one rank's weight bytes of DeepSeek-V3 and
V2-Lite under TP, DP attention and EP against the modules that rank builds (meta device), KV bytes per token,
the job's pools, refusals on real cards, the table of docs/parallelism.md, and benchmarks/multi_gpu_check.py's
`--num-layers fit`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from benchmarks import multi_gpu_check
from engine.args import EngineArgs
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.memory.formats import quantization_for
from engine.memory.plan import EXPERTS, GB, PlanSpec, kv_per_token, plan_memory
from engine.memory.plan_check import judge
from engine.runtime.launch_checks import dry_run_plan

BLOCK = (128, 128)
H100, H200 = 85 * GB, 150 * GB  # a card's total as CUDA reports it
DOC = Path(__file__).resolve().parent.parent / "docs" / "parallelism.md"


def config(alias):
    return parse_config(lookup(alias).config_dict())


def v3_spec(**kw) -> PlanSpec:
    return PlanSpec(config("deepseek-v3"), "deepseek-v3", quant=quantization_for("fp8", BLOCK), **kw)


@pytest.mark.parametrize("alias, tp, dp, ep", [
    ("deepseek-v3", 8, 1, 1), ("deepseek-v3", 16, 1, 1), ("deepseek-v3", 8, 8, 1), ("deepseek-v3", 8, 2, 8),
    ("deepseek-v3", 8, 1, 8), ("deepseek-v2-lite", 2, 1, 1), ("deepseek-v2-lite", 16, 1, 1),
    ("deepseek-v2-lite", 4, 4, 1),
])
def test_per_rank_bytes_match_the_full_size_shards(alias, tp, dp, ep):
    """The plan's weights per rank (and its routed-expert part) against the parameters and absorbed buffers the
    first and last rank's modules hold (V3 FP8 with its MTP layer, V2-Lite bf16), at full depth."""
    from engine.model.builder import make_modules  # lazy: the model stack
    from tests.distributed.test_model_ep import _group
    from tests.test_memory_plan import _rank_bytes

    cfg = config(alias)
    block = BLOCK if cfg.fp8 else None
    mtp = bool(cfg.num_nextn_predict_layers)
    plan = plan_memory(PlanSpec(cfg, tp=tp, dp=dp, ep=ep, mtp=mtp,
                                quant=quantization_for("fp8" if block else "bf16", block)))
    for rank in (0, tp - 1):
        with torch.device("meta"):
            mods = make_modules(cfg, cfg.num_hidden_layers, torch.bfloat16, block, _group(rank, tp, ep, dp), mtp=mtp)
        total, experts = _rank_bytes(mods)
        assert abs(plan.weight_bytes - total) <= 0.005 * total, (alias, tp, dp, ep, rank, plan.weight_bytes, total)
        assert abs(plan.weights[EXPERTS] - experts) <= 0.005 * experts


def test_kv_bytes_per_token():
    """Every cache layer's latent (the MTP layer's too), the same at every TP size; with --disable-mla this rank's
    heads x (qk + v)."""
    assert kv_per_token(v3_spec(tp=8)) == (61 + 1) * (512 + 64) * 2 == 71_424
    assert kv_per_token(v3_spec(tp=16, kv_dtype_bytes=1, mtp=False)) == 61 * 576
    assert kv_per_token(v3_spec(tp=8, expanded_kv=True)) == 62 * (128 // 8) * (192 + 128) * 2
    assert kv_per_token(v3_spec(tp=8, dp=8, expanded_kv=True)) == 62 * 128 * (192 + 128) * 2


def test_kv_tokens_per_rank():
    """The pool is what the budget leaves after the weights and the reserve, in whole tokens; doubling TP frees
    weight memory but keeps the bytes per token; DP attention (attention over fewer ranks) costs weights."""
    tp8 = plan_memory(v3_spec(tp=8, gpu_bytes=H200))
    left = H200 * 0.85 - tp8.weight_bytes - sum(tp8.reserve.values())
    assert tp8.memory_tokens * 71_424 <= left < (tp8.memory_tokens + 1) * 71_424
    tp16 = plan_memory(v3_spec(tp=16, gpu_bytes=H200))
    assert tp16.kv_per_token == tp8.kv_per_token and tp16.memory_tokens > 1.5 * tp8.memory_tokens
    assert plan_memory(v3_spec(tp=8, dp=8, gpu_bytes=H200)).weight_bytes > tp8.weight_bytes + 10 * GB


def test_dp_attention_job_holds_dp_pools():
    """Each DP group has its own pool, so the job's KV tokens are dp x a group's; plain TP holds one (duplicated)
    copy. A DP-attention GPU holds more attention weights, so fewer tokens per GPU; EP holds TP's bytes."""
    tp8, dp8, ep8 = (plan_memory(v3_spec(tp=8, gpu_bytes=H200, **kw)) for kw in ({}, {"dp": 8}, {"ep": 8}))
    assert tp8.job_tokens == tp8.pool_tokens and dp8.job_tokens == 8 * dp8.pool_tokens
    assert 0.5 * tp8.pool_tokens < dp8.pool_tokens < tp8.pool_tokens
    assert dp8.job_tokens > 4 * tp8.job_tokens
    assert ep8.pool_tokens == tp8.pool_tokens


def test_refusals_name_what_fits():
    """One line with the weights per GPU; a bf16 checkpoint too big for 4 x H100 is told --quantization fp8 (which
    does fit); a card nothing fits is told to use GPUs with more memory."""
    v3 = judge(plan_memory(v3_spec(tp=8, gpu_bytes=H100)))
    assert not v3.fits and "\n" not in v3.reason and "87.3 GB of weights per GPU" in v3.reason
    assert judge(plan_memory(v3_spec(tp=16, gpu_bytes=H100))).fits  # the --tp 16 fix does fit
    v2 = PlanSpec(config("deepseek-v2"), "deepseek-v2", tp=4, quant=quantization_for("bf16"), mtp=False,
                  gpu_bytes=H100)
    bf16 = judge(plan_memory(v2))
    assert not bf16.fits and "--quantization fp8: " in bf16.reason
    assert judge(plan_memory(dataclasses.replace(v2, quant=quantization_for("fp8", BLOCK)))).fits
    tiny_card = judge(plan_memory(v3_spec(tp=8, gpu_bytes=4 * GB)))
    assert not tiny_card.fits and tiny_card.reason.endswith("use GPUs with more memory")


def _doc_rows() -> list[list[str]]:
    """docs/parallelism.md's "Memory per GPU" table: [GPUs, FLAGS, weights, bf16 KV, fp8 KV] per row."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in DOC.read_text().splitlines()
            if re.match(r"\| [0-9x ]+H[12]00 \| `--tp", line)]
    assert len(rows) >= 5
    return rows


def _flags(text: str) -> dict:
    """`--tp 8 --enable-dp-attention` -> EngineArgs field values."""
    out, words = {}, text.strip("`").split()
    for i, word in enumerate(words):
        if word.startswith("--"):
            name = {"tp": "tp_size"}.get(word[2:], word[2:].replace("-", "_"))
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            out[name] = True if nxt.startswith("--") else int(nxt) if nxt.isdigit() else nxt
    if "nnodes" in out:
        out["dist_init_addr"] = "10.0.0.1:5000"
    return out


def test_parallelism_doc_table_is_the_dry_run():
    """Each row of the table is what `dsctl serve --model deepseek-v3 FLAGS --dry-run --gpu-memory-gb GB` plans (with
    a bf16, then an fp8 KV cache)."""
    for gpus, flags, weights, *kv_cells in _doc_rows():
        gb = 150 if "H200" in gpus else 85
        for kv_dtype, cell in zip(("auto", "fp8_e4m3"), kv_cells):
            args = EngineArgs.of(model="deepseek-v3", dry_run=True, gpu_memory_gb=gb, kv_cache_dtype=kv_dtype,
                                 **_flags(flags))
            plan, v = dry_run_plan(args)
            want = "refused" if not v.fits else f"{v.pool:,}" + (f" x {plan.spec.dp}" if plan.spec.dp > 1 else "")
            assert (weights, cell) == (f"{plan.weight_bytes / GB:.1f}", want), (gpus, flags, kv_dtype)


def test_multi_gpu_check_fits_the_deepest_truncation():
    """`--num-layers fit`: the deepest V3 truncation whose plan gives every layout a 64k-token pool on two H100s,
    less one spare layer; checked against plans built here from the layouts (DP attention's is the one that
    binds there)."""
    layouts = {"tp2": {}, "tp2-dp2": {"dp": 2}, "tp2-ep2": {"ep": 2}}
    base = dict(model="deepseek-v3", load_format="dummy", device="cuda", dtype="auto", max_model_len=1024)
    n = multi_gpu_check.fit_layers(base, list(layouts), H100)
    cfg = config("deepseek-v3")

    def tokens(layers: int, kw: dict) -> int:
        spec = PlanSpec(cfg.with_num_layers(layers), tp=2, quant=quantization_for("fp8", BLOCK), gpu_bytes=H100,
                        max_model_len=1024, **kw)
        return plan_memory(spec).memory_tokens

    assert 1 < n < cfg.num_hidden_layers
    assert all(tokens(n + 1, kw) >= 65536 for kw in layouts.values())
    assert any(tokens(n + 2, kw) < 65536 for kw in layouts.values())
