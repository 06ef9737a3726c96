"""--speculative-disable-by-batch-size: decode steps of that many requests or more run without speculation,
and the draft (MTP) layer's KV catches up in batched forwards, so later spec steps draft from the same KV
an all-speculative run would have written. Greedy output is plain decoding's either way."""

import pytest
import torch

import engine.speculative.decoder as decoder_mod
from engine.args import EngineArgs
from engine.engine import Engine
from engine.errors import UsageError
from engine.sampling import SamplingParams
from tests.speculative.helpers import FLAGS, SPEC, check_pool, prompts


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_flag_needs_speculation_and_a_positive_size():
    with pytest.raises(UsageError, match="--speculative-disable-by-batch-size needs --speculative-algorithm"):
        EngineArgs.of(device="cpu", speculative_disable_by_batch_size=8).validate()
    with pytest.raises(UsageError, match=">= 1"):
        EngineArgs.of(device="cpu", speculative_disable_by_batch_size=0, **SPEC).validate()
    assert EngineArgs.of(device="cpu", speculative_disable_by_batch_size=8, **SPEC).validate()


def test_switching_between_plain_and_spec_steps_keeps_greedy_output(monkeypatch):
    """32 requests of 4-43 new tokens: plain steps while 8 or more decode (with catch-ups of the draft KV
    after 16 plain steps), spec steps once the batch has shrunk; radix cache, chunked prefill and overlap on."""
    off = Engine(model="tiny", **FLAGS)
    on = Engine(model="tiny", **FLAGS, **SPEC, speculative_disable_by_batch_size=8)
    ps = prompts(off.config.vocab_size)
    params = [_greedy(4 + (7 * i) % 40) for i in range(len(ps))]
    caught_up = []
    real = decoder_mod.catch_up_pending

    def counting(reqs, device):
        caught_up.append(sum(r.kv_len - 1 - r.spec.mtp_len for r in reqs))
        return real(reqs, device)

    monkeypatch.setattr(decoder_mod, "catch_up_pending", counting)
    ref = off.generate(input_ids=ps, sampling_params=params)
    got = on.generate(input_ids=ps, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    stats = on.scheduler.stats()
    assert stats["spec_plain_steps"] > 16 and sum(stats["spec_accept_hist"]) > 0, stats
    steps = {kind: sum(counts) for kind, (counts, _) in stats["step_seconds"].items()}
    assert steps["spec"] > 0 and steps["decode"] == stats["spec_plain_steps"], steps
    assert caught_up and sum(caught_up) > 0
    check_pool(on)


def _draft_kv(eng, ids: list[int], n: int) -> torch.Tensor:
    """The MTP layer's cached KV of the first n positions of `ids` (held by the radix cache)."""
    slots, _ = eng.scheduler.cache.match_prefix(ids)
    assert slots.numel() >= n
    layer = eng.runner.config.num_hidden_layers  # the pool's extra layer after the decoder layers
    return eng.runner.kv_pool.read(layer, slots[:n], torch.float32)


def test_caught_up_draft_kv_equals_the_prefill_written_one():
    """Always plain (size 1), three requests: after 40 new tokens the draft KV of the positions caught up
    equals the KV a prefill of the same sequence writes (float32; decode rows vs one extend)."""
    plain = Engine(model="tiny", **FLAGS, **SPEC, speculative_disable_by_batch_size=1)
    ps = prompts(plain.config.vocab_size, n=3, seed=5)
    outs = plain.generate(input_ids=ps, sampling_params=_greedy(40))
    assert plain.scheduler.stats()["spec_plain_steps"] >= 39
    fresh = Engine(model="tiny", **FLAGS, **SPEC)
    for prompt, out in zip(ps, outs):
        seq = prompt + out.token_ids
        n = len(prompt) + 14  # caught up once 16 plain steps had run (a second time after 32)
        fresh.generate(input_ids=[seq], sampling_params=_greedy(1))
        want, got = _draft_kv(fresh, seq, n), _draft_kv(plain, seq, n)
        assert want[len(prompt):].abs().max() > 0.1  # written, not the pool's initial values
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
