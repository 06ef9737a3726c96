"""Speculative decoding at --tp 2 and under DP attention (CPU ranks, gloo): every rank commits its (attention
group's) rank 0's tree and acceptance, and
greedy token ids equal the one-process engine's with speculation off."""

import functools

import pytest

from engine.args import EngineArgs
from engine.engine import Engine
from engine.runtime.offline import RankedEngine
from engine.runtime.rank_loop import engine_main
from engine.sampling import SamplingParams
from tests.distributed.dp_graph_targets import padded_spec_engine
from tests.speculative.helpers import FLAGS, SPEC, prompts


def test_tp2_greedy_identical_to_one_process_without_spec():
    flags = dict(FLAGS, max_total_tokens=2048)
    off = Engine(EngineArgs.of(model="tiny", **flags))
    ps = prompts(off.config.vocab_size, n=4, seed=11)
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    ref = off.generate(input_ids=ps, sampling_params=params)
    with RankedEngine(EngineArgs.of(model="tiny", tp_size=2, **flags, **SPEC)) as eng:
        got = eng.generate(input_ids=ps, sampling_params=params)
        sampled = eng.generate(input_ids=ps[:2], sampling_params=SamplingParams(max_new_tokens=4, temperature=1.0,
                                                                                seed=3, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == 4 for o in sampled)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded-graphs"])
def test_dp_attention_greedy_identical_to_one_process_without_spec(padded):
    """--tp 2 --enable-dp-attention --dp 2 with speculation, on the trained tiny-py (its drafts are accepted,
    so the groups' spec steps emit different numbers of tokens and fall out of step with each other and
    with prefill steps): every forward is agreed between the groups (idle forwards of the other kind while
    a group drafts or prefills), and greedy tokens equal one process without speculation, with one group
    loaded alone and with both. `padded`: the forwards go through the CUDA-graph runners' padded batches
    (capture=False on CPU), so the groups also agree on graph sizes for MTP and target forwards."""
    main = functools.partial(engine_main, make_engine=padded_spec_engine) if padded else None
    flags = dict(FLAGS, max_total_tokens=2048)
    off = Engine(EngineArgs.of(model="tiny-py", **flags))
    ps = prompts(off.config.vocab_size, n=8, seed=5)
    params = [SamplingParams(max_new_tokens=6 + 3 * (i % 3), temperature=0, ignore_eos=True) for i in range(len(ps))]
    ref = [o.token_ids for o in off.generate(input_ids=ps, sampling_params=params)]
    with RankedEngine(EngineArgs.of(model="tiny-py", tp_size=2, enable_dp_attention=True, dp_size=2,
                                    dist_timeout=60, **flags, **SPEC),
                       rank_main=main) as eng:
        alone = eng.generate(input_ids=ps[:3], sampling_params=params[:3], dp_rank=1)
        both = eng.generate(input_ids=ps, sampling_params=params)
    assert [o.token_ids for o in alone] == ref[:3]
    assert [o.token_ids for o in both] == ref


def test_dp_attention_with_disable_by_batch_size_identical():
    """The same under DP attention with --speculative-disable-by-batch-size 2 and padded graphs: a group runs
    plain steps while 2 or more of its requests decode (26 / 31 of them: draft-KV catch-ups through the MTP
    layer after 16), then spec steps for its longest request, each group at its own pace; every forward is
    still agreed between the groups. With two-batch overlap splitting every target extend and plain decode of two
    or more requests (verify and MTP forwards run whole), amid the other groups' spec steps."""
    main = functools.partial(engine_main, make_engine=padded_spec_engine)
    flags = dict(FLAGS, max_total_tokens=2048)
    off = Engine(EngineArgs.of(model="tiny-py", **flags))
    ps = prompts(off.config.vocab_size, n=8, seed=5)
    params = [SamplingParams(max_new_tokens=6 + 5 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    ref = [o.token_ids for o in off.generate(input_ids=ps, sampling_params=params)]
    with RankedEngine(EngineArgs.of(model="tiny-py", tp_size=2, enable_dp_attention=True, dp_size=2,
                                    dist_timeout=60, speculative_disable_by_batch_size=2, enable_two_batch_overlap=True,
                                    two_batch_overlap_min_tokens=2, **flags, **SPEC),
                       rank_main=main) as eng:
        both = eng.generate(input_ids=ps, sampling_params=params)
        assert eng.stats.two_batch_forwards > 0
    assert [o.token_ids for o in both] == ref
