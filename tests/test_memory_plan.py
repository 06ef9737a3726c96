"""The memory plan (engine/memory/plan.py, plan_check.py): its weight bytes against the models the engine really
builds, the measured DeepSeek-V2 numbers, the refusals and their fixes, `dsctl serve --dry-run`'s exit codes and
`dsctl models --fit`."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
from engine.errors import UsageError
from engine.memory.fit import fit_rows
from engine.memory.formats import bytes_per_param, quantization_for
from engine.memory.plan import EXPERTS, GB, MTP, PlanSpec, kv_pool_tokens, plan_memory, used_by_others
from engine.memory.plan_check import judge
from tests.cli.screen import assert_fits, run_dsctl

BLOCK = (128, 128)
H100 = 85_029_158_912  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3
FP8, BF16 = quantization_for("fp8", BLOCK), quantization_for("bf16")


def config(alias):
    return parse_config(lookup(alias).config_dict())


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {t.data_ptr() if t.device.type != "meta" else id(t): t
                                                     for t in tensors}.values())


def _rank_bytes(modules) -> tuple[int, int]:
    """(every parameter + absorbed w_kc / w_vc, the routed experts' w13 / w2 and their scales) of one rank's modules;
    the MTP layer's embed / head are the model's (shared), so counted once."""
    from engine.weights.loader import iter_params  # lazy: the model stack, only for the tests that build it

    params = dict(iter_params(modules))
    absorbed = [b for m in modules.values() for n, b in m.named_buffers() if n.endswith(("w_kc", "w_vc"))]
    experts = [p for n, p in params.items() if n.startswith("layers.") and ".mlp.w" in n and "shared" not in n]
    shared_heads = {"mtp.embed_tokens.weight", "mtp.head.weight"}
    return _bytes([p for n, p in params.items() if n not in shared_heads] + absorbed), _bytes(experts)


@pytest.mark.parametrize("alias, quant", [("tiny", BF16), ("tiny-fp8", FP8)])
def test_weights_match_the_tiny_model_built_at_tp1(alias, quant):
    """The plan's per-rank weights (and its routed-expert part) against the model build_model really allocates on
    this machine (dummy weights, one process): the same bytes."""
    from engine.model.builder import build_model  # lazy: the model stack

    cfg = config(alias)
    model, mtp = build_model(cfg, cfg.num_hidden_layers, torch.bfloat16, "cpu", fp8_block=quant.fp8_block,
                             mtp=True, seed=random.randrange(1 << 16))
    total, experts = _rank_bytes({"": model, "mtp.": mtp})
    plan = plan_memory(PlanSpec(cfg, tp=1, quant=quant, mtp=True))
    mtp_experts = sum(p.numel() * p.element_size() for n, p in mtp.named_parameters() if ".mlp.w" in n)
    assert abs(plan.weight_bytes - total) <= 0.005 * total, (plan.weights, total)
    assert abs(plan.weights[EXPERTS] - experts) <= 0.005 * experts
    assert plan.weights[MTP] > mtp_experts > 0  # the MTP layer's own MoE is in its part, not in EXPERTS


@pytest.mark.parametrize("tp, dp, ep, int4", [(2, 1, 1, False), (4, 2, 1, False), (4, 1, 4, False),
                                               (4, 4, 1, True), (2, 1, 2, True), (4, 1, 1, True)])
def test_weights_match_the_tp_ep_dp_shards(tp, dp, ep, int4):
    """Per rank under TP, DP attention (attention and vocab over tp / dp ranks) and EP (whole experts), with FP8 or
    INT4 experts: the plan against the modules a rank builds (tests/distributed/test_model_ep.py's group, on the
    meta device), first and last rank: the same bytes (within 0.5%; the acceptance asks for a few %)."""
    from engine.model.builder import make_modules  # lazy: the model stack
    from tests.distributed.test_model_ep import _group

    cfg = config("tiny-fp8-tp")
    cfg = cfg.with_int4_experts() if int4 else cfg
    quant = quantization_for("w4afp8" if int4 else "fp8", BLOCK)
    plan = plan_memory(PlanSpec(cfg, tp=tp, dp=dp, ep=ep, quant=quant, mtp=True))
    for rank in (0, tp - 1):
        with torch.device("meta"):
            mods = make_modules(cfg, cfg.num_hidden_layers, torch.bfloat16, BLOCK, _group(rank, tp, ep, dp), mtp=True)
        total, experts = _rank_bytes(mods)
        assert abs(plan.weight_bytes - total) <= 0.005 * total, (tp, dp, ep, rank, plan.weight_bytes, total)
        assert abs(plan.weights[EXPERTS] - experts) <= 0.005 * experts, (plan.weights[EXPERTS], experts)


def test_bytes_per_param_table():
    table = bytes_per_param()
    assert table["bf16"] == (2.0, 2.0)
    assert table["fp8"][0] == table["fp8"][1] == pytest.approx(1 + 4 / 128**2)
    assert table["w4afp8"] == (pytest.approx(1 + 4 / 128**2), pytest.approx(0.5 + 4 / 128))


# The H100 measurements below held V2's router in bf16; it is float32 now (engine/model/moe.py): this many more
# bytes per rank (59 MoE layers x 160 experts x 5120), and that many fewer KV tokens of 69,120 bytes.
ROUTER_GROWTH = 59 * 160 * 5120 * 2
ROUTER_GROWTH_TOKENS = ROUTER_GROWTH // 69_120


def v2_spec(**kw):
    return PlanSpec(config("deepseek-v2"), "deepseek-v2", tp=4, quant=FP8, mtp=False, gpu_bytes=H100, **kw)


def test_deepseek_v2_reproduces_the_h100_measurements():
    """Measured on 4 x H100, DeepSeek-V2 FP8 dummy: --tp 4 --enable-dp-attention logged weights 67.6 GB and a pool
    of 1490 tokens; --tp 4 alone 138,661 tokens per rank. The plan refuses the first and names the fix. Those runs
    held the router in bf16 (ROUTER_GROWTH)."""
    dp = plan_memory(v2_spec(dp=4))
    absorbed = 60 * 128 * (128 + 128) * 512 * 2  # w_kc / w_vc, bf16, whole on each rank at attention TP 1
    assert abs((dp.weight_bytes - absorbed - ROUTER_GROWTH) / GB - 67.6) < 0.3
    assert abs(dp.memory_tokens + ROUTER_GROWTH_TOKENS - 1490) < 100  # 0.1 GB of 69,120-byte tokens is 1,447
    tp = plan_memory(v2_spec())
    assert abs(tp.memory_tokens + ROUTER_GROWTH_TOKENS - 138_661) < 0.01 * 138_661
    v = judge(dp)
    assert not v.fits and "below --min-kv-tokens 4,096" in v.reason
    drop = next(f for f in v.fixes if f.flags == "drop --enable-dp-attention")
    assert drop.tokens == tp.memory_tokens and f"drop --enable-dp-attention: {drop.tokens:,} KV tokens" in v.reason
    # at real start-up the fix's tokens are the real pool moved by the plan's difference
    real = judge(dp, pool=1490)
    drop = next(f for f in real.fixes if f.flags == "drop --enable-dp-attention")
    assert drop.tokens == (1490 * dp.kv_per_token + tp.kv_bytes - dp.kv_bytes) // tp.kv_per_token
    assert abs(drop.tokens - 138_661) < 0.03 * 138_661


def test_plan_and_runner_size_the_pool_by_one_rule():
    """The plan's pool is `kv_pool_tokens` of what the runner would find in use (weights + reserve + others'), and
    `dsctl serve --dry-run` on a bare 4 x H100 (its own CUDA context in use: V2 --tp 4 planned 128,938 tokens when
    that context was counted as another process's) plans the measured 138,661 within 1%."""
    plan = plan_memory(v2_spec())
    used = plan.weight_bytes + sum(plan.reserve.values())
    budget = H100 * 0.85 - used
    assert plan.memory_tokens == kv_pool_tokens(H100, used, 0.85, 69_120) == int(budget // 69_120)
    assert kv_pool_tokens(H100, H100, 0.85, 69_120) == 0  # nothing left: 0, and the checks refuse
    own_context = (137_104 - 128_938) * 69_120  # what the dry run saw in use on an idle machine
    seen = plan_memory(v2_spec(gpu_used_bytes=used_by_others(H100, H100 - own_context)))
    assert abs(seen.memory_tokens + ROUTER_GROWTH_TOKENS - 138_661) < 0.01 * 138_661
    busy = plan_memory(v2_spec(gpu_used_bytes=used_by_others(H100, H100 - own_context - 10 * GB)))
    assert abs(seen.kv_bytes - busy.kv_bytes - 10 * GB) < 0.02 * GB  # another process's 10 GB: 10 GB less KV
    # a rank that has joined its NCCL groups (DP attention's too) holds their reserves itself: not another process's
    joined = own_context + (0.41 + 0.17) * GB
    assert used_by_others(H100, H100 - joined, communicators=True, dp_attention=True) == used_by_others(
        H100, H100 - own_context)
    assert used_by_others(H100, H100 - joined) == pytest.approx(used_by_others(H100, H100 - own_context) + 0.58 * GB)
    one_gpu = plan_memory(dataclasses.replace(v2_spec(), tp=1))
    assert sum(plan.reserve.values()) - sum(one_gpu.reserve.values()) == pytest.approx(0.41 * GB)  # NCCL


def test_memory_other_processes_hold_is_named():
    """A GPU part-held by another process (a server still exiting): a plan that fits beside it warns what it
    costs in KV tokens; one that no longer fits is refused with the held GB in the reason and freeing it as the
    first fix, with the tokens an idle GPU gives; below OTHERS_NOTED nothing is said."""
    idle = plan_memory(v2_spec())
    busy = plan_memory(v2_spec(gpu_used_bytes=4 * GB))
    v = judge(busy)
    assert v.fits and v.pool == busy.pool_tokens
    (held,) = [w for w in v.warnings if "other processes" in w]
    lost = idle.pool_tokens - busy.pool_tokens
    assert "4.0 GB" in held and f"{lost:,} tokens per DP group smaller" in held and f"({idle.pool_tokens:,})" in held
    assert abs(lost * idle.kv_per_token - 4 * GB) < idle.kv_per_token  # the held bytes, in tokens
    full = judge(plan_memory(v2_spec(gpu_used_bytes=60 * GB)))
    assert not full.fits and "60.0 GB of the GPU held by other processes" in full.reason
    assert full.fixes[0].flags.startswith("free the 60.0 GB other processes hold")
    assert full.fixes[0].tokens == idle.memory_tokens
    quiet = judge(plan_memory(v2_spec(gpu_used_bytes=0.5 * GB)))
    assert not any("other processes" in w for w in quiet.warnings)


def test_max_model_len_speaks_first():
    """A pool below --min-kv-tokens and shorter than --max-model-len: the refusal names the length the user
    gave, offers no shorter length (that would fail --min-kv-tokens), and every fix gives room for it."""
    v = judge(plan_memory(v2_spec(dp=4, max_model_len=160_000)))
    assert not v.fits and "one request of --max-model-len 160,000 tokens does not fit" in v.reason
    assert "below --min-kv-tokens 4,096" in v.reason and "give --max-model-len" not in v.reason
    assert v.fixes and all(f.tokens >= 160_000 for f in v.fixes)
    assert all(f"{f.flags}: {f.tokens:,} KV tokens" in v.reason for f in v.fixes)
    alone = judge(plan_memory(v2_spec(dp=4)))  # no --max-model-len: the --min-kv-tokens rule
    assert not alone.fits and "below --min-kv-tokens 4,096" in alone.reason and "max-model-len" not in alone.reason


def test_fix_tokens_are_the_plan_rerun_with_that_change():
    """DeepSeek-V3 FP8 does not fit 8 x H100; each fix named gives what an independently built plan gives, and
    passes the rule; a fix that would not pass is not named."""
    v3 = config("deepseek-v3")
    spec = PlanSpec(v3, "deepseek-v3", tp=8, quant=quantization_for("fp8", BLOCK), gpu_bytes=H100)
    v = judge(plan_memory(spec))
    assert not v.fits and plan_memory(spec).memory_tokens == 0
    by_flags = {f.flags: f.tokens for f in v.fixes}
    int4 = plan_memory(dataclasses.replace(spec, quant=quantization_for("w4afp8", BLOCK))).memory_tokens
    assert by_flags["--quantization w4afp8 (INT4 experts)"] == int4 > 4096
    assert by_flags["--tp 16 --nnodes 2 (16 GPUs)"] == plan_memory(dataclasses.replace(spec, tp=16)).memory_tokens
    assert not any("kv-cache-dtype" in f for f in by_flags)  # an FP8 cache alone leaves the weights too big
    assert judge(plan_memory(dataclasses.replace(spec, gpu_bytes=150 * GB))).fits  # 8 x H200


def test_context_rules():
    """--max-model-len longer than the pool: refused, with a shorter one as the fix; not given: the context limit
    becomes the pool (a warning); fewer requests than --max-running-requests of a typical length: a warning."""
    plan = plan_memory(v2_spec())
    pool = plan.memory_tokens
    v = judge(plan_memory(v2_spec(max_model_len=160_000)))
    assert not v.fits and "one request of --max-model-len 160,000 tokens does not fit" in v.reason
    assert v.fixes[0].flags == f"--max-model-len {pool // 1024 * 1024}"
    assert "--kv-cache-dtype fp8_e4m3" in v.reason  # a cache half the size holds 160k tokens
    ok = judge(plan_memory(v2_spec(max_model_len=pool)))
    assert ok.fits and ok.context_limit == pool
    free = judge(plan)
    assert free.fits and free.context_limit == pool < 163_840
    assert any(f"context limit becomes {pool:,} tokens" in w for w in free.warnings)
    assert any("fewer than --max-running-requests 256" in w for w in free.warnings)
    few = judge(plan_memory(v2_spec(max_running_requests=8)))
    assert not any("max-running-requests" in w for w in few.warnings)
    low = judge(plan, pool=4095)  # the real start-up's pool: the same rules
    assert not low.fits and "a KV pool of 4,095 tokens per DP group, below --min-kv-tokens 4,096" in low.reason


def test_launch_check_refuses_with_the_plan_reason(monkeypatch):
    """check_launch's CUDA branch (the card's total memory from CUDA) raises the plan's refusal."""
    from engine.args import EngineArgs
    from engine.runtime import launch_checks

    class Props:
        total_memory = H100

    monkeypatch.setattr(launch_checks, "pick_device", lambda _: torch.device("cuda"))
    monkeypatch.setattr(launch_checks, "_visible_gpus", lambda _: 8)
    monkeypatch.setattr(launch_checks.torch.cuda, "get_device_properties", lambda _: Props)
    args = EngineArgs.of(model="deepseek-v2", load_format="dummy", quantization="fp8", tp_size=4,
                         enable_dp_attention=True)
    with pytest.raises(UsageError, match="drop --enable-dp-attention: 1[34][0-9],[0-9]{3} KV tokens"):
        launch_checks.check_launch(args)
    launch_checks.check_launch(args.replace(enable_dp_attention=False))


def test_runner_refuses_before_loading_when_others_hold_the_memory(monkeypatch):
    """The rank's check before any weight is read (ModelRunner._memory_held_elsewhere, CUDA only: run here on a
    stand-in runner with CUDA's free-memory answer faked): 60 GB held elsewhere on an H100 refuses V2 at --tp 4
    with the held memory in the reason; 4 GB is returned for the pool check; an idle GPU gives 0."""
    from types import MethodType, SimpleNamespace

    from engine.args import EngineArgs
    from engine.checkpoint.resolve import resolve_model
    from engine.memory.plan import CUDA_CONTEXT_BYTES, NCCL_RESERVE_BYTES
    from engine.runner import model_runner

    args = EngineArgs.of(model="deepseek-v2", load_format="dummy", quantization="fp8", tp_size=4)
    resolved = resolve_model(args.model)
    tp = SimpleNamespace(size=4, dp_size=1, ep_size=1)  # rank 0 of 4; the max over ranks: this rank's value
    # the rank holds its CUDA context and (having joined its NCCL groups) their communicators: neither is others'
    runner = SimpleNamespace(device=torch.device("cuda"), parallel=SimpleNamespace(tp=tp), resolved=resolved,
                             args=args, config=resolved.config, fp8_block=(128, 128))
    runner._plan_spec = MethodType(model_runner.ModelRunner._plan_spec, runner)
    monkeypatch.setattr(model_runner, "all_reduce_min_int", lambda value, group: value)
    monkeypatch.setattr(model_runner.torch.cuda, "device_count", lambda: 8)
    held = model_runner.ModelRunner._memory_held_elsewhere
    for others, expect in ((60 * GB, None), (4 * GB, 4 * GB), (0.0, 0.0)):
        monkeypatch.setattr(model_runner.torch.cuda, "mem_get_info",
                            lambda _, o=others: (H100 - o - CUDA_CONTEXT_BYTES - NCCL_RESERVE_BYTES, H100))
        if expect is None:
            with pytest.raises(UsageError, match="60.0 GB of the GPU held by other processes.*free the 60.0 GB"):
                held(runner)
        else:
            assert held(runner) == pytest.approx(expect, abs=1)


def test_dry_run_exit_codes():
    """`dsctl serve --dry-run` (no GPU, no weights): V3 FP8 at --tp 8 on 85 GB cards exits 2 with the reason and
    the fixes (a real `dsctl` process), on 150 GB cards 0 (in-process); the table fits 80 columns."""
    bad = run_dsctl("serve", "--model", "deepseek-v3", "--tp", "8", "--dry-run", "--gpu-memory-gb", "85")
    assert bad.returncode == 2, bad.stderr
    assert "does not fit" in bad.stdout and "error: deepseek-v3 at --tp 8" in bad.stderr
    assert "--quantization w4afp8 (INT4 experts)" in bad.stderr and "--tp 16 --nnodes 2" in bad.stderr
    from typer.testing import CliRunner

    from dsctl.cli import app

    good = CliRunner().invoke(app, ["serve", "--model", "deepseek-v3", "--tp", "8", "--dry-run", "--gpu-memory-gb",
                                    "150"], env={"COLUMNS": "80"})
    assert good.exit_code == 0, good.output
    assert "fits" in good.stdout and "routed experts" in good.stdout and "MTP layer" in good.stdout
    assert_fits(good.stdout)


def test_gpu_memory_needs_dry_run():
    from engine.args import EngineArgs

    with pytest.raises(UsageError, match="--gpu-memory-gb is the card"):
        EngineArgs.of(gpu_memory_gb=80).validate()


def test_models_fit_table():
    rows = {(r.models.split(",")[0], r.quant, r.layout): r.cells for r in fit_rows()}
    h100, h200, h200x4 = rows[("deepseek-v3", "fp8", "TP")]
    assert h100.startswith("no") and h200x4.startswith("no") and h200.endswith("k")
    assert not rows[("deepseek-v3", "w4afp8", "TP")][0].startswith("no")  # INT4 experts: V3 on 8 x H100
    assert rows[("deepseek-v3", "w4afp8", "TP + DP attention")][2].endswith("x 4")
    # a bf16 checkpoint under --quantization fp8: 128 x 128 blocks, which TP 8 cannot split but EP 8 can
    assert rows[("deepseek-v2", "fp8", "TP")][0] == "n/a (split)" != rows[("deepseek-v2", "bf16", "TP")][0]
    fp8_ep, bf16_ep = (int(rows[("deepseek-v2", q, "TP + EP")][0][:-1]) for q in ("fp8", "bf16"))
    assert fp8_ep > 2 * bf16_ep
