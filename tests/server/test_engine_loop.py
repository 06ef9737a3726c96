"""The engine process's loop in-process (no pipes, no HTTP): its deltas, put back together by the serving
side's `Sequence`, equal the offline Engine's outputs; bad prompts are refused with the same message by the
server's input check and by the engine; shutdown aborts what is left."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.engine import Engine
from engine.runtime.protocol import AddFailed, AddRequest, EngineInfo, Shutdown, StepOutputs
from engine.runtime.rank_loop import EngineLoop
from engine.sampling import SamplingParams
from engine.server.errors import APIError
from engine.server.generation import Sequence
from engine.server.inputs import check_prompt


class Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def engine():
    return Engine(model="tiny", device="cpu", dtype="float32")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _params(engine, prompts) -> list[SamplingParams]:
    probe = engine.generate(input_ids=prompts[:3], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True))
    text = probe[1].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isprintable()), "never")
    return [
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop=[stop, "not there"]),
        SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[probe[2].token_ids[4]]),
        SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=True, skip_special_tokens=False),
        SamplingParams(max_new_tokens=0),
    ]


def _run_loop(engine, prompts, params) -> tuple[dict[str, Sequence], dict[str, str]]:
    outbox = Outbox()
    loop = EngineLoop(engine, outbox)
    seqs = {f"r{i}": Sequence(ids, copy.deepcopy(p), engine.tokenizer)
            for i, (ids, p) in enumerate(zip(prompts, params))}
    for rid, seq in seqs.items():
        loop.handle(AddRequest(rid, seq.prompt_ids, copy.deepcopy(seq.params)))
    for _ in range(200):
        loop.step()
        loop.send_outputs()
        if not engine.scheduler.has_work():
            break
    streamed = dict.fromkeys(seqs, "")
    for msg in outbox.sent:
        assert isinstance(msg, StepOutputs)
        for out in msg.outputs:
            assert not seqs[out.rid].finished, "a delta after the request's final one"
            streamed[out.rid] += seqs[out.rid].apply(out)
    return seqs, streamed


def test_server_side_deltas_equal_offline_outputs(engine):
    prompts = _prompts(6, seed=1)
    params = _params(engine, prompts)
    offline = engine.generate(input_ids=prompts, sampling_params=params)
    seqs, streamed = _run_loop(engine, prompts, params)
    assert offline[1].matched_stop == params[1].stop[0] and offline[2].finish_reason == "stop"
    for (rid, seq), want, p in zip(seqs.items(), offline, params):
        assert seq.finished, rid
        assert seq.output_ids == want.token_ids
        assert (seq.finish_reason, seq.matched_stop) == (want.finish_reason, want.matched_stop)
        assert seq.text == streamed[rid] == want.text
        if p.logprobs:
            torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
        else:
            assert seq.logprobs == [] and want.logprobs is None
        if p.top_logprobs:
            assert [[t for t, _ in top] for top in seq.top_logprobs] == [[t for t, _ in top] for top in
                                                                         want.top_logprobs]
        if p.prompt_logprobs:
            assert seq.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
            torch.testing.assert_close(torch.tensor(seq.prompt_logprobs[1:]), torch.tensor(want.prompt_logprobs[1:]),
                                       atol=1e-4, rtol=0)


def test_bad_prompts_get_the_same_message_from_server_and_engine(engine):
    runner = engine.runner
    info = EngineInfo(max_model_len=runner.max_model_len, vocab_size=engine.config.vocab_size,
                      kv_total_tokens=int(runner.kv_pool.size), max_running_requests=1, pid=0)
    outbox = Outbox()
    loop = EngineLoop(engine, outbox)
    bad = {"empty": [], "too long": [1] * runner.max_model_len, "vocab": [1, engine.config.vocab_size + 3, 2]}
    for name, ids in bad.items():
        with pytest.raises(APIError) as server_side:
            check_prompt(ids, info)
        loop.handle(AddRequest(name, ids, SamplingParams(max_new_tokens=2)))
        refused = outbox.sent[-1]
        assert isinstance(refused, AddFailed) and refused.rid == name and refused.user_error
        assert refused.message == server_side.value.message, name
    assert server_side.value.code is None
    with pytest.raises(APIError) as exc:
        check_prompt([1] * runner.max_model_len, info)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "prompt"


def test_shutdown_aborts_every_request_with_a_final_delta(engine):
    outbox = Outbox()
    loop = EngineLoop(engine, outbox)
    prompts = _prompts(3, seed=2)
    for i, ids in enumerate(prompts):
        loop.handle(AddRequest(f"s{i}", ids, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)))
    loop.step()
    loop.send_outputs()
    assert loop.handle(Shutdown()) is False
    final = {o.rid: o for o in outbox.sent[-1].outputs}
    assert sorted(final) == ["s0", "s1", "s2"] and all(o.finish_reason == "abort" for o in final.values())
    engine.scheduler.flush()
    assert not engine.scheduler.has_work() and engine.scheduler.take_outputs() == []


class _QueuedClient:
    """Generation's client: submit records the sink; everything the engine sent is queued before it is read."""

    def __init__(self):
        self.rids = []

    def check_capacity(self, n):
        pass

    def submit(self, prompt_ids, params, sink, tag, grammar=None):
        self.sink = sink
        self.rids.append(f"r{len(self.rids)}")
        return self.rids[-1]

    def abort(self, rid):
        pass


def test_queued_outputs_go_out_as_one_event_per_sequence_run(engine):
    """The server fell behind the engine: every delta of two sequences (one with log-probs and top log-probs,
    one with prompt log-probs) is queued at once. events() gives one event per run of a sequence's outputs,
    the prompt log-probs' output an event of its own, and the same text, tokens and log-probs as one event per
    delta."""
    import asyncio

    from engine.server.generation import Generation

    prompts = _prompts(2, seed=4)
    params = [SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2),
              SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=True)]
    one_by_one, streamed = _run_loop(engine, prompts, params)
    outbox = Outbox()
    loop = EngineLoop(engine, outbox)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        loop.handle(AddRequest(f"r{i}", ids, copy.deepcopy(p)))
    while engine.scheduler.has_work():
        loop.step()
        loop.send_outputs()
    deltas = [out for msg in outbox.sent for out in msg.outputs]
    client = _QueuedClient()
    seqs = [Sequence(ids, copy.deepcopy(p), engine.tokenizer) for ids, p in zip(prompts, params)]
    gen = Generation(client, seqs)
    gen.submit()
    by_rid = dict(zip(client.rids, range(len(seqs))))
    for out in sorted(deltas, key=lambda o: o.rid):  # every delta of r0, then of r1: two runs at most
        client.sink.put_nowait((by_rid[out.rid], out))

    async def read():
        return [(i, text, out) for i, text, out in [e async for e in gen.events()]]

    events = asyncio.run(read())
    assert [i for i, _, _ in events] == [0, 1, 1], "r0's deltas in one event; r1's prompt log-probs alone"
    assert events[1][2].prompt_logprobs is not None and events[2][2].finished
    for i, seq in enumerate(seqs):
        want = one_by_one[f"r{i}"]
        assert seq.finished and seq.output_ids == want.output_ids and seq.text == want.text
        assert "".join(text for j, text, _ in events if j == i) == streamed[f"r{i}"]
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in seq.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]
