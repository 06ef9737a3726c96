"""Engine factories for spawned ranks (engine_main's `make_engine`) in the DP-attention padded-decode tests
and the mirrored prefill-cap test.

`padded_decode_engine` builds the normal Engine and then routes its decode batches through the CUDA
graph runner's padded static batches and its extend batches through the piecewise graphs' cut (token
buckets 16, 32, 64; not under two-batch overlap, as on a GPU), both with capture=False: the same padding,
per-size batches, size and bucket agreement between DP groups and idle padding replays as on a GPU, run
eagerly on the CPU.
"""

from __future__ import annotations

from engine.engine import Engine
from engine.scheduler.prefill_budget import PrefillBudget

PADDED_SIZES = [1, 2, 4, 8]
PIECEWISE_BUCKETS = [16, 32, 64]  # the tests' steps: at most 48 prompt tokens and 8 decode rows


def padded_decode_engine(args, local_rank: int, prefill_forwards: bool = False) -> Engine:
    """With `prefill_forwards`, every rank first runs the start-up precompile's recording forwards (eagerly here:
    on a GPU their launches are skipped): under DP attention their gathers pair up across the groups."""
    engine = Engine(args, local_rank=local_rank)
    if prefill_forwards:
        _run_prefill_forwards(engine)
    engine.runner.build_graph_runner(PADDED_SIZES, capture=False)
    if engine.runner.forward_ctx.two_batch is None:
        engine.runner.build_piecewise(PIECEWISE_BUCKETS, capture=False)
    return engine


def _run_prefill_forwards(engine: Engine) -> None:
    """The recording forwards, each checked to give every gathering MLP the rows of every DP group (the width the
    kernels recorded for it will run at)."""
    import torch

    runner = engine.runner
    groups, rows = runner.parallel.tp.dp_size, []
    gathering = [layer.mlp for layer in runner.model.layers
                 if not (layer.is_moe and layer.mlp.tp.exchanges_tokens)]  # all-to-all MoE layers see own rows
    hooks = [mlp.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for mlp in gathering]
    try:
        with torch.inference_mode():
            for forward in runner.prefill_forwards():
                rows.clear()
                forward()
                reqs, _, n = forward.args
                assert rows == [groups * reqs * n] * len(gathering), (forward.args, rows)
    finally:
        for hook in hooks:
            hook.remove()


def padded_flashinfer_engine(args, local_rank: int) -> Engine:
    """padded_decode_engine with its attention the FlashInfer backend over tests/engine/fake_flashinfer.py (FlashInfer
    0.7's planner internals included): the padded decode batches' wrappers read the request table in place, an idle
    DP group's padding rows included."""
    import pytest
    import torch

    from engine.model.attention_flashinfer import FlashInferAttentionBackend
    from tests.engine import fake_flashinfer

    fake_flashinfer.install(pytest.MonkeyPatch())  # this process only; never undone
    engine = Engine(args, local_rank=local_rank)
    r, cfg = engine.runner, engine.runner.config
    heads = cfg.num_attention_heads // r.parallel.tp.attention.size
    r.forward_ctx.attn_backend = FlashInferAttentionBackend(
        heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, torch.float32, r.kv_pool.dtype,
        r.kv_pool.scale, r.device, r.req_to_token.table.shape[1], max_graph_bs=max(PADDED_SIZES))
    r.build_graph_runner(PADDED_SIZES, capture=False)
    r.build_piecewise(PIECEWISE_BUCKETS, capture=False)
    assert r.forward_ctx.attn_backend.in_place is None  # decided at the first graph batch
    return engine


def padded_spec_engine(args, local_rank: int) -> Engine:
    """The same for speculative decoding: its tree forwards (up to 8 rows per request) through padded
    batches of the model's and the MTP layer's graph runners, larger ones eagerly."""
    engine = Engine(args, local_rank=local_rank)
    engine.runner.build_graph_runner([1, 2, 4, 8, 16, 32], capture=False)
    return engine


def skewed_clock_engine(args, local_rank: int) -> Engine:
    """Extends through the piecewise-graph cut run eagerly (capture=False), and a prefill cap with a 5 ms target
    fed synthetic step times (1 ms + 10 us per token), 50x slower on rank 1: with its own state rank 0 would
    take the whole step budget and rank 1 the 1-token floor."""
    engine = Engine(args, local_rank=local_rank)
    engine.runner.build_piecewise([16, 32, 64], capture=False)
    budget = engine.scheduler.prefill_budget = PrefillBudget(itl_target_ms=5.0, min_tokens=1)
    engine.scheduler.prefill_burst = False  # the prompts arrive at once: capped steps, not one burst
    observe, scale = budget.observe, 50.0 if local_rank == 1 else 1.0
    budget.observe = lambda kind, tokens, seconds: observe(kind, tokens, scale * (1e-3 + 1e-5 * tokens))
    return engine
