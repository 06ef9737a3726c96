"""The prefill cap that follows the decode load (--itl-target-ms): the line it fits to the extend steps, the
cap it derives (mixed steps: the step itself within the target; alternating: the step plus a decode step),
and on the tiny model, mixed and alternating, a run where every prefill step taken while requests decode stays
within the cap, prompts still progress, decodes are never starved, and the outputs equal the uncapped run's."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler.prefill_budget import ITL_AUTO_FACTOR, WARMUP_STEPS, PrefillBudget
from tests.scheduler.helpers import assert_settled, swap_scheduler


def _taught(budget: PrefillBudget, fixed=0.004, per_token=1e-5, decode=0.01) -> PrefillBudget:
    for tokens in (100, 900, 2000, 4000, 300):
        budget.observe("extend", tokens, fixed + per_token * tokens)
    for _ in range(5):
        budget.observe("decode", 0, decode)
    return budget


def test_line_recovers_fixed_and_per_token_cost():
    fixed, per_token = _taught(PrefillBudget(0.0, 64)).extend.fit()
    assert fixed == pytest.approx(0.004, rel=1e-6)
    assert per_token == pytest.approx(1e-5, rel=1e-6)


def test_cap_from_auto_and_fixed_targets():
    auto = _taught(PrefillBudget(0.0, 64))
    # the gap a stream sees: this step plus its decode step, within 3 decode steps
    want = int((ITL_AUTO_FACTOR * 0.01 - 0.004 - 0.01) / 1e-5)
    assert auto.tokens(8192, decoding=8) == pytest.approx(want, abs=1)
    assert auto.tokens(8192, decoding=0) == 8192  # nothing waits: the whole budget
    assert auto.tokens(1000, decoding=8) == 1000  # never above the step budget
    fixed = _taught(PrefillBudget(20.0, 64))
    assert fixed.tokens(8192, decoding=1) == pytest.approx((0.020 - 0.004 - 0.01) / 1e-5, abs=1)
    tight = _taught(PrefillBudget(5.0, 64))  # the fixed cost alone exceeds it: the floor keeps prompts moving
    assert tight.tokens(8192, decoding=1) == 64
    assert tight.tokens(32, decoding=1) == 32  # nor the floor above the step budget
    off = _taught(PrefillBudget(-1.0, 64))
    assert off.tokens(8192, decoding=8) == 8192


def test_mixed_cap_counts_the_decode_rows_not_a_decode_step():
    auto = _taught(PrefillBudget(0.0, 64))
    # the stream waits for the mixed step alone; its 8 decode rows are tokens of that step
    want = int((ITL_AUTO_FACTOR * 0.01 - 0.004) / 1e-5) - 8
    assert auto.tokens(8192, decoding=8, mixed=True) == pytest.approx(want, abs=1)
    assert auto.tokens(8192, decoding=8, mixed=True) > auto.tokens(8192, decoding=8)
    heavy = _taught(PrefillBudget(0.0, 64))  # decodes alone fill the target: the floor keeps prompts moving
    assert heavy.tokens(8192, decoding=3000, mixed=True) == 64


def test_mixed_steps_teach_the_line():
    b = PrefillBudget(0.0, 64)
    for tokens in (100, 900, 2000, 4000):
        b.observe("mixed", tokens, 0.004 + 1e-5 * tokens)
    assert b.extend.fit() == pytest.approx((0.004, 1e-5), rel=1e-6)
    # no decode step seen yet (every step mixed): a decode step of 100 requests as the line predicts it
    decode = 0.004 + 1e-5 * 100
    assert b.target_seconds(100) == pytest.approx(ITL_AUTO_FACTOR * decode)
    want = int((ITL_AUTO_FACTOR * decode - 0.004) / 1e-5) - 100
    assert b.tokens(8192, decoding=100, mixed=True) == pytest.approx(want, abs=1)


def test_no_cap_until_the_line_is_known():
    b = PrefillBudget(0.0, 64)
    for _ in range(WARMUP_STEPS + 2):  # always the same size: no slope to fit
        b.observe("extend", 512, 0.01)
    b.observe("decode", 0, 0.01)
    assert b.tokens(8192, decoding=4) == 8192


def test_recent_steps_weigh_more():
    b = _taught(PrefillBudget(0.0, 64))
    for tokens in (500, 1500, 3000) * 20:  # the machine got twice as slow per token
        b.observe("extend", tokens, 0.004 + 2e-5 * tokens)
    assert b.extend.fit()[1] == pytest.approx(2e-5, rel=0.05)


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _workload():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 60, 70, 4, 66, 8, 55)]
    params = [SamplingParams(max_new_tokens=12 + i % 4, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_new_tokens=12 + i % 4, temperature=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("mixed", [False, True])
def test_capped_steps_while_decoding(engine, monkeypatch, mixed):
    prompts, params = _workload()
    swap_scheduler(engine, chunked_prefill_size=64, itl_target_ms=-1, enable_mixed_chunk=False)
    ref = engine.generate(input_ids=prompts, sampling_params=params)

    sched = swap_scheduler(engine, chunked_prefill_size=64, itl_target_ms=30.0, min_prefill_tokens=4,
                           enable_mixed_chunk=mixed, prefill_burst=False)
    budget = _taught(sched.prefill_budget, fixed=0.004, per_token=1e-3, decode=0.01)  # cap: 16 tokens
    monkeypatch.setattr(budget, "observe", lambda *a: None)  # keep the taught line (CPU timings vary)
    cap = budget.tokens(64, decoding=1)
    assert cap == pytest.approx(16, abs=1)
    steps = []  # (prompt tokens, requests decoding, decodes riding) per extend step
    launch = sched._launch_extend

    def record(chunks, decodes):
        steps.append((sum(c.end - c.start for c in chunks), len(sched._decodable()), len(decodes)))
        return launch(chunks, decodes)
    monkeypatch.setattr(sched, "_launch_extend", record)
    got = engine.generate(input_ids=prompts, sampling_params=params)

    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for tokens, decoding, riding in steps:
        if decoding:  # mixed: 30 ms holds 26 tokens after the fixed 4 ms, the decode rows among them
            limit = max(4, 26 - riding) if riding else cap
            assert tokens <= limit, steps
    assert any(tokens > cap for tokens, decoding, _ in steps if not decoding), steps  # idle: the whole budget
    assert any(riding for *_, riding in steps) == mixed, steps
    if not mixed:
        assert sched.stats()["decode_steps"] > 0
    assert_settled(engine, sched)


def _burst_workload(n=10, length=40):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (length + i,), generator=g).tolist() for i in range(n)]
    params = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def _recorded_steps(sched, monkeypatch) -> list[tuple]:
    """(kind, prompt tokens, requests decoding, decodes riding) of every launched step."""
    steps = []
    extend, decode = sched._launch_extend, sched._launch_decode

    def on_extend(chunks, decodes):
        steps.append(("extend", sum(c.end - c.start for c in chunks), len(sched._decodable()), len(decodes)))
        return extend(chunks, decodes)

    def on_decode(reqs):
        steps.append(("decode", 0, len(reqs), 0))
        return decode(reqs)
    monkeypatch.setattr(sched, "_launch_extend", on_extend)
    monkeypatch.setattr(sched, "_launch_decode", on_decode)
    return steps


def _capped_scheduler(engine, monkeypatch, **flags):
    sched = swap_scheduler(engine, chunked_prefill_size=64, itl_target_ms=30.0, min_prefill_tokens=4,
                           enable_mixed_chunk=True, **flags)
    budget = _taught(sched.prefill_budget, fixed=0.004, per_token=1e-3, decode=0.01)  # mixed cap: 26 tokens
    monkeypatch.setattr(budget, "observe", lambda *a: None)
    return sched


def test_burst_prefills_arrivals_back_to_back_at_the_full_budget(engine, monkeypatch):
    """Ten prompts at once: after the first step (nothing decodes yet) more could start than decode, so the
    cap gives way: pure prefill steps of the whole 64-token budget run back to back, no decode in between or
    riding along, until every prompt has started; then decodes. Outputs equal the uncapped run's."""
    prompts, params = _burst_workload()
    swap_scheduler(engine, chunked_prefill_size=64, itl_target_ms=-1, enable_mixed_chunk=False)
    ref = engine.generate(input_ids=prompts, sampling_params=params)

    sched = _capped_scheduler(engine, monkeypatch)
    steps = _recorded_steps(sched, monkeypatch)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]

    first_decode = next(i for i, s in enumerate(steps) if s[0] == "decode")
    burst = steps[:first_decode]
    assert sum(tokens for _, tokens, _, _ in burst) == sum(map(len, prompts)), steps  # every prompt started
    assert all(riding == 0 for *_, riding in burst), steps
    assert any(decoding and tokens == 64 for _, tokens, decoding, _ in burst), steps  # uncapped while decoding
    assert all(kind == "decode" for kind, *_ in steps[first_decode:]), steps
    assert_settled(engine, sched)


def test_no_burst_when_arrivals_trickle(engine, monkeypatch):
    """Prompts arriving one per step while more requests decode: no burst, so every prefill step taken while
    requests decode stays within the mixed cap (26 tokens with its decode rows); --no-prefill-burst gives the
    same steps for the same arrivals."""
    prompts, params = _burst_workload(n=12, length=30)
    runs = {}
    for burst in (True, False):
        sched = _capped_scheduler(engine, monkeypatch, prefill_burst=burst)
        steps = _recorded_steps(sched, monkeypatch)
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs[:4]:
            sched.add(r)
        while sched.waiting or sched.prefilling is not None:
            sched.step()
        queue = reqs[4:]
        while queue or sched.has_work():
            if queue:
                sched.add(queue.pop(0))
            sched.step()
        sched.flush()
        capped = [s for s in steps[len([s for s in steps if not s[2]]):] if s[0] == "extend" and s[2] > 1]
        assert capped and all(tokens <= max(4, 26 - riding) for _, tokens, _, riding in capped), steps
        runs[burst] = steps
        assert_settled(engine, sched)
    assert runs[True] == runs[False]


def test_burst_counts_only_what_the_kv_pool_can_start():
    """With room in the pool for about two more prompts, four waiting and two decoding, no burst starts (a
    burst would take only what fits, then stall the decodes for nothing); with a large pool it does."""
    prompts, params = _burst_workload(n=6, length=100)
    for total, want in ((420, False), (4096, True)):
        eng = Engine(model="tiny", device="cpu", dtype="float32", max_total_tokens=total, chunked_prefill_size=64,
                     itl_target_ms=30.0)
        sched = eng.scheduler
        reqs = [eng.make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs[:2]:
            sched.add(r)
        while len(sched._decodable()) < 2:
            sched.step()
        for r in reqs[2:]:
            sched.add(r)
        assert sched._burst(sched._decodable()) is want
        sched.abort_all()
        sched.flush()


def test_a_burst_stalls_the_decodes_for_at_most_its_step_limit(engine, monkeypatch):
    """A burst longer than BURST_MAX_STEPS (2 here) is cut there: the decodes then get as many steps (riding in
    capped mixed steps) before another burst may start, so they are never starved; same outputs."""
    import engine.scheduler.scheduler as scheduler_module

    prompts, params = _burst_workload(n=12, length=60)
    swap_scheduler(engine, chunked_prefill_size=64, itl_target_ms=-1, enable_mixed_chunk=False)
    ref = engine.generate(input_ids=prompts, sampling_params=params)

    monkeypatch.setattr(scheduler_module, "BURST_MAX_STEPS", 2)
    sched = _capped_scheduler(engine, monkeypatch)
    steps = _recorded_steps(sched, monkeypatch)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    stalls = "".join("s" if kind == "extend" and decoding and not riding else "." for kind, _, decoding, riding
                     in steps)
    assert "ss" in stalls and "sss" not in stalls, (stalls, steps)  # bursts of 2, never longer
    for run in stalls.split("ss")[1:-1]:  # between two bursts: at least 2 steps in which the decodes advance
        assert len(run) >= 2, (stalls, steps)
    assert_settled(engine, sched)
