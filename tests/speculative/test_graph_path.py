"""Speculative steps through the CUDA-graph path, on CPU: the model's and the MTP layer's graph runners
built with capture=False run the same padded static batches as on a GPU (tree rows' KV lists in the
request table's scratch rows, the MTP hidden-state input in a static buffer, padding rows), eagerly.
Greedy tokens equal the engine without speculation, on the trained tiny-py (long accepted runs, so a
decode step's draft extend has several positions per request)."""

from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.same_outputs import logprob_gap
from tests.speculative.helpers import FLAGS, SPEC, check_pool, prompts

SIZES = [1, 2, 4, 8, 16, 24, 32, 64]  # batches of more rows than 64 run eagerly with their own tree table


def _count_replays(monkeypatch, graphs) -> list[int]:
    calls, real = [0], graphs.replay

    def counted(fb, bs=None):
        calls[0] += 1
        return real(fb, bs)

    monkeypatch.setattr(graphs, "replay", counted)
    return calls


def test_padded_graph_spec_steps_identical(monkeypatch):
    off = Engine(model="tiny-py", **FLAGS)
    on = Engine(model="tiny-py", **FLAGS, **SPEC)
    on.runner.build_graph_runner(SIZES, capture=False)
    assert on.runner.req_to_token.num_scratch == max(SIZES)
    target, mtp = _count_replays(monkeypatch, on.runner.graphs), _count_replays(monkeypatch, on.runner.draft.graphs)
    ps = prompts(off.config.vocab_size, n=24, seed=7)
    params = [SamplingParams(max_new_tokens=5 + i % 7, temperature=0, ignore_eos=True, logprobs=True)
              for i in range(len(ps))]
    ref = off.generate(input_ids=ps, sampling_params=params)
    got = on.generate(input_ids=ps, sampling_params=params)
    assert logprob_gap(got, ref) < 1e-4
    assert target[0] > 0 and mtp[0] > 0, "the spec steps never went through the graph runners"
    assert on.scheduler.spec.stats.mean > 1.5, "tiny-py's drafts should be accepted"
    check_pool(on)
    eager = Engine(model="tiny-py", **FLAGS, **SPEC)
    eager.generate(input_ids=ps, sampling_params=params)
    assert on.scheduler.spec.stats.hist == eager.scheduler.spec.stats.hist, "the drafts differ from eager ones"
