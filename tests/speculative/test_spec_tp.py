"""Speculative decoding at --tp 2 (CPU ranks, gloo): every rank commits rank 0's tree and acceptance, and
greedy token ids equal the one-process engine's with speculation off."""

from engine.args import EngineArgs
from engine.engine import Engine
from engine.ranked import RankedEngine
from engine.sampling import SamplingParams
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
