"""benchmarks/bench_spec.py's tok/s measurement: the timed generate call runs exactly the shapes of the
untimed one before it.

Its prompts are random ids; with tiny-py's 264-token vocabulary the timed prompts' first tokens collide
with the untimed call's. With the radix cache on, those hits shortened the timed prefill (511 tokens
instead of 512 at batch 8), a batch the untimed call never ran: on a GPU it needed a Triton
specialisation of its own (the MoE align kernel's token count no longer a multiple of 16), JIT-compiled
inside the timed spec-on call, about a second that made batches 8 and 32 look 3-4x slower per step than
their steady state. Each discarded scheduler's cache also kept its KV slots, shrinking the pool for the
measurements after it."""

import importlib.util
import os

import pytest

from engine.engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = (2, 4, 4)


@pytest.fixture(scope="module")
def bench_spec():
    spec = importlib.util.spec_from_file_location("bench_spec", os.path.join(ROOT, "benchmarks", "bench_spec.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_timed_generate_repeats_the_untimed_shapes(bench_spec):
    bs, input_len, output_len = 8, 64, 6
    vocab = 264
    timed, untimed = (bench_spec._prompts(bs, input_len, vocab, seed=s) for s in (1, 2))
    assert {p[0] for p in timed} & {p[0] for p in untimed}, "premise: these prompts would hit a radix cache"
    eng = Engine(model="tiny-py", device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch",
                 num_layers=3, max_running_requests=bs, max_model_len=input_len + output_len + 64,
                 max_total_tokens=4096, chunked_prefill_size=8192, max_prefill_tokens=16384,
                 speculative_algorithm="NEXTN", **bench_spec._tree_flags(TREE))
    assert eng.config.vocab_size == vocab
    pool = eng.runner.kv_pool
    for tree in (TREE, None):
        r = bench_spec.tok_s(eng, bs, input_len, output_len, tree)
        assert r["hit_tokens"] == 0
        assert r["new_shapes"] == [], "the timed call ran prefill shapes the untimed one did not"
        t = r["timed"]
        assert t["tokens"] == bs * output_len and t["extend_steps"] == 1 and t["decode_steps"] > 0
        assert t["eager"] > 0  # CPU: no CUDA graphs, every forward is eager
        if tree is not None:
            assert r["accepted"] > 1.0
        assert pool.available() == pool.size, "the benchmark's schedulers keep KV slots"


def test_same_routing_sends_every_token_to_the_same_experts_and_random_restores(bench_spec):
    """bench_spec.Routing: "same" makes every MoE layer (the MTP layer's too) route all tokens alike; "random"
    brings back the loaded router, under which random tokens pick different experts."""
    import torch
    import torch.nn.functional as F

    from engine.model.moe import select_experts

    eng = Engine(model="tiny-fp8", device="cpu", dtype="float32", attention_backend="torch", moe_backend="torch",
                 speculative_algorithm="NEXTN", **bench_spec._tree_flags(TREE))
    routing = bench_spec.Routing(eng)
    assert len(routing.moes) > 1 and any(m in set(eng.runner.mtp.modules()) for m in routing.moes)
    x = torch.randn(16, eng.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def ids():
        return [select_experts(F.linear(x, m.gate_weight.float()), m.cfg, m.e_score_correction_bias)[1].sort(-1).values
                for m in routing.moes]

    loaded = ids()
    assert all(len({tuple(r) for r in layer.tolist()}) > 1 for layer in loaded)
    routing.set("same")
    assert all(len({tuple(r) for r in layer.tolist()}) == 1 for layer in ids())
    routing.set("random")
    assert all(torch.equal(a, b) for a, b in zip(ids(), loaded))
