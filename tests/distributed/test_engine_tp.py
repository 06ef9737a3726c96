"""Tensor parallel end to end on CPU (gloo): N engine rank processes against the one-process engine.

Every test here starts real rank processes (engine/runtime/offline.py -> ranks.py -> rank_loop.py),
so the model is split by heads / intermediate / vocab with real all-reduces and gathers.
Greedy token ids must be identical to one process; log-probs agree to 1e-4 absolute: on CPU in
float32 the only difference is the order in which the all-reduce sums the ranks' partial
products (rounding of order 1e-7 per layer), far below that bound but above bit-exactness.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.args import EngineArgs
from engine.engine import Engine
from engine.errors import UsageError
from engine.runtime.launch_checks import check_launch
from engine.runtime.offline import RankedEngine
from engine.runtime.ranks import EngineRankError
from engine.sampling import SamplingParams
from tests.same_outputs import logprob_gap

# Radix cache on (shared prefixes below), chunked prefill with small chunks, overlap scheduler on.
FLAGS = dict(device="cpu", dtype="float32", chunked_prefill_size=16, max_prefill_tokens=48,
             max_running_requests=8, max_total_tokens=2048, attention_backend="torch", moe_backend="torch")
LOGPROB_ATOL = 1e-4


def _prompts(vocab: int, n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(3, vocab, (1 + (7 * i) % 37,), generator=g).tolist()
        out.append(shared + tail if i % 3 == 0 else tail)  # a third share a 20-token prefix
    return out


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=4 + i % 5, temperature=0, ignore_eos=True, logprobs=True)
            for i in range(n)]


@pytest.fixture(scope="module")
def reference():
    """One-process outputs per model (computed once)."""
    cache = {}

    def get(model: str):
        if model not in cache:
            eng = Engine(EngineArgs.of(model=model, **FLAGS))
            prompts = _prompts(eng.config.vocab_size)
            cache[model] = (prompts, eng.generate(input_ids=prompts, sampling_params=_params(len(prompts))))
        return cache[model]

    return get


EP = dict(ep_size=None)  # --ep-size = --tp
DPA = dict(enable_dp_attention=True)


# Four ranks share this machine's two cores: each 4-rank case costs 4-6x a 2-rank one, so TP 4 runs the FP8
# model (its block scales split four ways too) for plain TP and EP, on the first 4 prompts only (two share a
# prefix; one spans three prefill chunks); DP attention
# at TP 4 (attention TP 2 inside each of 2 groups) runs in the padded-decode test below (eager extends, padded
# decodes).
# ("tiny", 2) runs with --all-reduce-backend custom: on CPU it must fall back to gloo (same tokens).
# --moe-a2a-backend torch (EP by all-to-all): at TP 2 with DP attention in the padded-decode test below (eager
# extends: the variable mode; graph-shaped decodes: the fixed one), and at TP 2 without DP attention and at TP 4
# (its tokens split over the 2 ranks of each attention group, variable counts per rank) with redundant experts in
# test_redundant_experts_and_routing_counts, which also runs DP attention + EP by gather.
@pytest.mark.parametrize("model, tp, layout", [
    ("tiny", 2, dict(all_reduce_backend="custom")), ("tiny-fp8", 2, {}), ("tiny-fp8", 4, {}),
    ("tiny", 2, EP), ("tiny-fp8", 2, EP),
    ("tiny", 2, dict(DPA, dp_size=2)), ("tiny-fp8", 2, dict(DPA, dp_size=2)),
], ids=lambda v: "-".join(k for k in ("ep_size", "dp_size", "moe_a2a_backend", "all_reduce_backend") if k in v)
   or "tp"
   if isinstance(v, dict) else None)
def test_greedy_tokens_identical_to_one_process(reference, model, tp, layout):
    prompts, ref = reference(model)
    n = 4 if tp > 2 else len(prompts)
    prompts, ref = prompts[:n], ref[:n]
    layout = {k: tp if v is None else v for k, v in layout.items()}
    with RankedEngine(EngineArgs.of(model=model, tp_size=tp, **layout, **FLAGS)) as eng:
        if not layout.get("enable_dp_attention"):  # TP: one pool, duplicated on every rank (DP: one per group)
            assert eng.info.kv_total_tokens == FLAGS["max_total_tokens"]
        got = eng.generate(input_ids=prompts, sampling_params=_params(n))
    worst = logprob_gap(got, ref)
    assert len({t for o in ref for t in o.token_ids}) > 8, "degenerate outputs: the comparison would be weak"
    assert worst <= LOGPROB_ATOL, f"log-probs differ by {worst:.2e}"


def test_dp_attention_uneven_load_and_kv_capacity(reference):
    """Every request on DP group 1 while group 0 idles (it runs idle forwards for group 1's MoE layers):
    no hang, the same tokens; then spread over both groups by total_tokens (the default). Group 1's pool
    then holds its finished requests' prefixes, evictable: the controller weighs both groups as idle.
    Each DP group has its own KV pool, so the job holds dp x a plain-TP rank's pool (acceptance 3),
    reported at start-up."""
    prompts, ref = reference("tiny")
    n = 8
    with RankedEngine(EngineArgs.of(model="tiny", tp_size=2, enable_dp_attention=True, dp_size=2, dist_timeout=60,
                                    **FLAGS)) as eng:
        assert eng.info.dp_kv_tokens == (FLAGS["max_total_tokens"],) * 2
        assert eng.info.kv_total_tokens == 2 * FLAGS["max_total_tokens"]
        got = eng.generate(input_ids=prompts[:n], sampling_params=_params(n), dp_rank=1)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref[:n]]
        used, weighed = eng.stats.dp_kv_used_tokens, eng.stats.dp_kv_load_tokens
        assert used[1] >= used[0] + sum(map(len, prompts[:n])) // 2 and weighed == (0, 0), (used, weighed)
        got = eng.generate(input_ids=prompts, sampling_params=_params(len(prompts)))
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        sent = [b - a for a, b in zip((0, n), eng.stats.dp_requests)]
        assert min(sent) >= 4 and sum(sent) == len(prompts), sent
    # plain TP's single pool (kv_total_tokens = one rank's) is checked in test_greedy_tokens_identical_to_one_process


A2A = dict(ep_size=None, moe_a2a_backend="torch")


@pytest.mark.parametrize("model, tp, dp, layout", [("tiny", 2, 2, A2A), ("tiny-fp8", 4, 2, {})],
                         ids=["dp2-a2a", "dp2-tp4"])
def test_dp_attention_padded_decode_matches_one_process(reference, model, tp, dp, layout):
    """Decode through padded static batches as CUDA graphs run them, extends (and decodes while another group
    extends) through the piecewise graphs' cut (capture=False on CPU): the DP groups agree on one padded size
    or token bucket per step (a group with fewer tokens pads; an idle group replays padding rows only), so
    no forward runs eagerly. Same greedy tokens as one process, with one group loaded alone (at
    TP 2; TP 4's four ranks on CI's two cores make each phase slow) and with both loaded. With
    --moe-a2a-backend torch the graph-shaped forwards run the exchange's fixed-size mode and the eager ones its
    variable mode (plain TP with the exchange, each rank exchanging its padded share of the batch, runs in
    test_redundant_experts_and_routing_counts). Each rank first runs the start-up precompile's recording forwards
    (every group gathering the others' rows at the forward's width)."""
    import functools

    from engine.runtime.rank_loop import engine_main
    from tests.distributed.dp_graph_targets import padded_decode_engine

    prompts, ref = reference(model)
    main = functools.partial(engine_main, make_engine=functools.partial(padded_decode_engine, prefill_forwards=True))
    layout = {k: tp if v is None else v for k, v in layout.items()}
    dpa = dict(enable_dp_attention=True, dp_size=dp)
    n = 4 if tp > 2 else 8 if layout else len(prompts)  # all-to-all: half the prompts, TP 4 a quarter (CI time)
    prompts, ref = prompts[:n], ref[:n]
    with RankedEngine(EngineArgs.of(model=model, tp_size=tp, **dpa, **layout, dist_timeout=60, **FLAGS),
                      rank_main=main) as eng:
        if tp == 2:
            got = eng.generate(input_ids=prompts[:5], sampling_params=_params(5), dp_rank=1)
            assert [o.token_ids for o in got] == [o.token_ids for o in ref[:5]]
        got = eng.generate(input_ids=prompts, sampling_params=_params(len(prompts)))
        paths = eng.stats.forward_paths
    worst = logprob_gap(got, ref)
    assert worst <= LOGPROB_ATOL, f"log-probs differ by {worst:.2e}"
    assert paths.get("piecewise", 0) > 0 and paths.get("cuda_graph", 0) > 0 and not paths.get("eager"), paths


def test_dp_attention_flashinfer_graph_decode_matches_one_process(reference):
    """The FlashInfer backend (tests/engine/fake_flashinfer.py's kernels, on CPU) under DP attention: padded decode
    batches whose wrappers read the request table in place, with group 0 idle (replaying padding rows) while
    group 1 decodes, then both loaded; the same greedy tokens as one process."""
    import functools

    from engine.runtime.rank_loop import engine_main
    from tests.distributed.dp_graph_targets import padded_flashinfer_engine

    prompts, ref = reference("tiny")
    main = functools.partial(engine_main, make_engine=padded_flashinfer_engine)
    with RankedEngine(EngineArgs.of(model="tiny", tp_size=2, enable_dp_attention=True, dp_size=2, dist_timeout=60,
                                    **FLAGS), rank_main=main) as eng:
        got = eng.generate(input_ids=prompts[:4], sampling_params=_params(4), dp_rank=1)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref[:4]]
        got = eng.generate(input_ids=prompts[:8], sampling_params=_params(8))
        paths = eng.stats.forward_paths
    assert logprob_gap(got, ref[:8]) <= LOGPROB_ATOL
    assert paths.get("cuda_graph", 0) > 0 and not paths.get("eager"), paths


def _placement_file(path, model: str, ep: int, redundant: int) -> str:
    """A placement planned from a made-up skewed load for every MoE layer of `model` (the MTP layer's too)."""
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup
    from engine.distributed.expert_placement import plan_placement

    cfg = parse_config(lookup(model).config_dict())
    layers = [i for i in range(cfg.num_hidden_layers + 1) if cfg.is_moe_layer(i)]
    load = {i: [1 + (7 * e * e + 3 * i) % 23 for e in range(cfg.n_routed_experts)] for i in layers}
    plan_placement(load, ep, redundant).save(path)
    return str(path)


TBO = dict(enable_two_batch_overlap=True, two_batch_overlap_min_tokens=2)  # split every forward that can be


@pytest.mark.parametrize("model, tp, layout", [
    ("tiny", 2, dict(EP, enable_dp_attention=True, dp_size=2)), ("tiny", 2, dict(A2A, **TBO)),
    ("tiny", 2, dict(EP, enable_dp_attention=True, dp_size=2, **TBO)),
    ("tiny-fp8", 4, dict(A2A, enable_dp_attention=True, dp_size=2, **TBO)),
], ids=["ep2-dp2-gather", "tp2-a2a-tbo", "ep2-dp2-gather-tbo", "ep4-dp2-a2a-tbo"])
def test_redundant_experts_and_routing_counts(reference, tmp_path, model, tp, layout):
    """Redundant experts from a placement file (a hot expert's picks spread over its copies on different ranks)
    give one process's tokens, through the gather path under DP attention and the all-to-all exchange, with
    decodes through padded (CUDA-graph-shaped) batches; and the routing counts the ranks record add up to
    top_k x the tokens forwarded per MoE layer (the radix cache off: each prompt token forwarded once, then
    one token per decode step), padding rows and idle groups not counted, each EP rank's share summing to it,
    and per expert as one process counts them. With two-batch overlap (every forward of two or more requests
    split, its collectives started asynchronously and interleaved with the other micro-batch's compute), the same
    tokens and counts, and the engine says forwards were split."""
    import functools

    from engine.runtime.rank_loop import engine_main
    from tests.distributed.dp_graph_targets import padded_decode_engine

    prompts, ref = reference(model)
    n = 4 if tp > 2 else 8
    prompts, ref, params = prompts[:n], ref[:n], _params(n)
    layout = {k: tp if v is None else v for k, v in layout.items()}
    flags = dict(FLAGS, disable_radix_cache=True, record_expert_load=True)
    placement = _placement_file(tmp_path / "placement.json", model, tp, redundant=tp)
    with RankedEngine(EngineArgs.of(model=model, tp_size=tp, expert_placement=placement, dist_timeout=60, **layout,
                                    **flags), rank_main=functools.partial(engine_main,
                                                                          make_engine=padded_decode_engine)) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=params)
        report = eng.expert_load()
        split = eng.stats.two_batch_forwards
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert (split > 0) == bool(layout.get("enable_two_batch_overlap")), split
    one = Engine(EngineArgs.of(model=model, **flags))
    one.generate(input_ids=prompts, sampling_params=params)
    want = one.runner.expert_load_report()
    top_k = one.config.num_experts_per_tok
    forwarded = sum(map(len, prompts)) + sum(p.max_new_tokens - 1 for p in params)
    mtp = one.config.num_hidden_layers
    assert report.ep_size == tp and set(report.layers) == set(want.layers)
    for layer, counts in report.layers.items():
        total = 0 if layer == mtp else top_k * forwarded  # no speculative decoding: the MTP layer idles
        assert sum(counts.logical) == sum(counts.ranks) == sum(want.layers[layer].logical) == total, layer
        moved = sum(abs(a - b) for a, b in zip(counts.logical, want.layers[layer].logical))
        assert moved <= 0.01 * total, (layer, counts.logical, want.layers[layer].logical)


def test_mirrored_prefill_cap_and_piecewise_extends(reference):
    """The prefill cap follows measured step times, which differ per rank: here rank 1 sees every step 50x
    slower (its own cap would be the floor while rank 0's is the whole budget), yet both admit the same prompt
    tokens (rank 0's cap state reaches every rank with its messages), and their collectives stay paired. The
    extends run through the piecewise-graph cut (capture=False): all-reduces inside the pieces, attention
    between them. Same greedy tokens as one process."""
    import functools

    from engine.runtime.rank_loop import engine_main
    from tests.distributed.dp_graph_targets import skewed_clock_engine

    prompts, ref = reference("tiny")
    main = functools.partial(engine_main, make_engine=skewed_clock_engine)
    with RankedEngine(EngineArgs.of(model="tiny", tp_size=2, dist_timeout=60, **FLAGS), rank_main=main) as eng:
        got = eng.generate(input_ids=prompts, sampling_params=_params(len(prompts)))
    worst = logprob_gap(got, ref)
    assert worst <= LOGPROB_ATOL, f"log-probs differ by {worst:.2e}"


def test_sampled_tokens_follow_rank_0(reference):
    """Sampling (temperature 1, unseeded): every rank continues with rank 0's token, so the run ends
    cleanly with outputs of the asked length (a rank that diverged would desynchronise the mirror)."""
    prompts, _ = reference("tiny")
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True) for _ in prompts[:6]]
    with RankedEngine(EngineArgs.of(model="tiny", tp_size=2, **FLAGS)) as eng:
        first = eng.generate(input_ids=prompts[:6], sampling_params=params)
        again = eng.generate(input_ids=prompts[:6], sampling_params=params)  # the ranks are still in step
    assert all(len(o.token_ids) == 6 for o in first + again)


@pytest.mark.parametrize("flags, message", [
    (dict(tp_size=3), "3"),
    (dict(tp_size=2, nnodes=2), "needs --dist-init-addr"),
    (dict(tp_size=2, dp_size=2), "needs --enable-dp-attention"),
    (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "dividing --tp 4"),
    (dict(tp_size=4, ep_size=2), "must equal --tp 4"),
])
def test_bad_layouts_are_rejected_before_loading(flags, message):
    flags = {"model": "tiny", **flags}
    with pytest.raises(UsageError, match=message) as exc:
        check_launch(EngineArgs.of(device="cpu", **flags))
    assert "\n" not in str(exc.value)


def test_a_killed_rank_fails_the_engine_with_its_name():
    eng = RankedEngine(EngineArgs.of(model="tiny", tp_size=2, dist_timeout=30, **FLAGS))
    try:
        victim = eng.pids[1]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineRankError, match=r"rank 1 \(pid \d+\) failed: killed by SIGKILL"):
            eng.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=50, temperature=0))
        assert time.monotonic() - start < 30
    finally:
        eng.close()
    assert not eng.alive()


def test_generate_cli_prints_the_same_text_with_tp():
    def run(*extra):
        cmd = [sys.executable, "-m", "dsctl", "generate", "--model", "tiny", "--device", "cpu", "-p", "Hello world",
               "-p", "The quick brown fox", "--max-new-tokens", "8", "--json", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert run("--tp", "2") == run()


def test_enable_dp_attention_alone_runs_on_one_rank(caplog):
    """`dsctl serve --enable-dp-attention` as typed: on CPU (or one GPU) it spans the one rank there is."""
    with caplog.at_level("WARNING"):
        check_launch(EngineArgs.of(model="tiny", device="cpu", enable_dp_attention=True))
    assert "same as plain attention" in caplog.text
