"""The output processor on its own: resolved samples -> request state and deltas.

The reference is the straightforward algorithm: after every token, decode the
whole output and look for each stop string in it. Token streams come from a
byte-level tokenizer whose pieces split UTF-8 characters (some hold whole
characters and the start of another), with a special token, so stop strings span
token and step boundaries and meet incomplete characters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from engine.sampling import SampleResult, SamplingParams
from engine.scheduler.output import CollectedOutput
from engine.scheduler.processor import OutputProcessor
from engine.scheduler.request import Request

PIECES = [b"a", b"b", b"ab", b"c ", b" d", b"ST", b"OP", b"S", b"TOP", b"\n", b"xy\xe2", b"\x82\xac", b"\xc3",
          b"\xa9", b"\xf0\x9f", b"\x99\x82", b"e\xc3", b"\xff"]
SPECIAL = len(PIECES)  # decodes to "<s>" unless special tokens are skipped
EOS = SPECIAL + 1  # decodes to "</s>" unless skipped
MAX_MODEL_LEN = 64


class PieceTokenizer:
    """Token id -> bytes (PIECES) or a special token; decodes like a byte-level BPE (U+FFFD for broken bytes)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text, run = "", b""
        for t in ids:
            if t < SPECIAL:
                run += PIECES[t]
                continue
            text, run = text + run.decode("utf-8", errors="replace"), b""
            if not skip_special_tokens:
                text += "<s>" if t == SPECIAL else "</s>"
        return text + run.decode("utf-8", errors="replace")


TOK = PieceTokenizer()


@dataclass
class Expected:
    tokens: list[int]
    finish: Optional[str]
    matched: object = None
    stop_text: Optional[str] = None


def reference(stream: list[int], p: SamplingParams, prompt_len: int) -> Expected:
    """Full re-decode after every token (the quadratic algorithm the processor must agree with)."""
    out: list[int] = []
    for tok in stream:
        out.append(tok)
        if (not p.ignore_eos and tok == EOS) or tok in p.stop_token_ids:
            return Expected(out, "stop", tok)
        if p.stop:
            text = TOK.decode(out, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s and s in text]
            if hits:
                pos, s = min(hits)
                return Expected(out, "stop", s, text[:pos])
        if len(out) >= p.max_new_tokens or prompt_len + len(out) >= MAX_MODEL_LEN:
            return Expected(out, "length")
    return Expected(out, None)


def _lp(step: int, tok: int) -> float:
    return -0.01 * (tok + 1) - 0.001 * step


def _top(step: int, tok: int, k: int) -> list[tuple[int, float]]:
    return [(tok + i, _lp(step, tok + i)) for i in range(k)]


def _result(step: int, toks: list[int], params: list[SamplingParams]) -> SampleResult:
    return SampleResult(tokens=list(toks), logprobs=[_lp(step, t) for t in toks],
                        top=[_top(step, t, p.top_logprobs) for t, p in zip(toks, params)])


def _run(streams: list[list[int]], params: list[SamplingParams], prompts: list[list[int]], emit: bool = True,
         take_every: int = 1, seed: int = 0):
    """Feed one token per request per step (requests already finished get tokens too: they must be discarded)."""
    proc = OutputProcessor(TOK, {EOS}, MAX_MODEL_LEN, emit=emit)
    reqs = [Request.new(str(i), pr, p) for i, (pr, p) in enumerate(zip(prompts, params))]
    collected = {r.rid: CollectedOutput() for r in reqs}
    deltas = []
    rng = random.Random(seed)
    for step in range(max(len(s) for s in streams)):
        live = [i for i, s in enumerate(streams) if step < len(s)]
        toks = [streams[i][step] for i in live]
        proc.process([reqs[i] for i in live], _result(step, toks, [params[i] for i in live]))
        if rng.randrange(take_every) == 0:
            deltas += proc.take()
    deltas += proc.take()
    for d in deltas:
        assert not collected[d.rid].finished, "a delta came after the request's final one"
        collected[d.rid].add(d)
    return reqs, collected, deltas


def _check(req: Request, got: CollectedOutput, want: Expected, prompt: list[int], p: SamplingParams, step0: int = 0):
    assert req.output_ids == want.tokens and req.prompt_ids == prompt
    assert (req.finish_reason, req.matched_stop) == (want.finish, want.matched)
    assert got.output_ids == want.tokens
    assert (got.finish_reason, got.matched_stop, got.stop_text) == (want.finish, want.matched, want.stop_text)
    if p.logprobs or p.top_logprobs:
        assert got.logprobs == [_lp(step0 + i, t) for i, t in enumerate(want.tokens)]
    else:
        assert got.logprobs == []
    assert got.top_logprobs == ([_top(step0 + i, t, p.top_logprobs) for i, t in enumerate(want.tokens)]
                                if p.top_logprobs else [])


def _random_case(rng: random.Random):
    n = rng.randint(1, 30)
    stream = [rng.choice(range(SPECIAL + 2)) if rng.random() < 0.1 else rng.randrange(SPECIAL) for _ in range(n)]
    text = TOK.decode(stream, skip_special_tokens=False)
    stops = []
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.7 and len(text) > 1:  # a piece of the text: often spans token boundaries
            a = rng.randrange(len(text) - 1)
            stops.append(text[a:a + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["zz", "STOP", "a\n", "€", "é", "ab c"]))
    p = SamplingParams(max_new_tokens=rng.randint(1, n), stop=stops, ignore_eos=rng.random() < 0.3,
                       stop_token_ids=[rng.randrange(SPECIAL)] if rng.random() < 0.2 else [],
                       logprobs=rng.random() < 0.5, top_logprobs=rng.choice([0, 0, 2]),
                       skip_special_tokens=rng.random() < 0.7)
    prompt = [rng.randrange(SPECIAL) for _ in range(rng.randint(1, 50))]
    return stream + [rng.randrange(SPECIAL) for _ in range(3)], p, prompt  # extra tokens after any finish


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_match_full_redecode(seed):
    rng = random.Random(seed)
    cases = [_random_case(rng) for _ in range(40)]
    streams, params, prompts = (list(x) for x in zip(*cases))
    reqs, collected, _ = _run(streams, params, prompts, take_every=3, seed=seed)
    for req, s, p, pr in zip(reqs, streams, params, prompts):
        want = reference(s, p, len(pr))
        assert want.finish is not None  # every stream outlives max_new_tokens or stops
        _check(req, collected[req.rid], want, pr, p)
    assert sum(w.stop_text is not None for w in (reference(s, p, len(pr)) for s, p, pr in cases)) > 10


def _one(pieces: list[bytes], **kw) -> tuple[Request, CollectedOutput, list]:
    stream = [PIECES.index(x) for x in pieces]
    p = SamplingParams(**{"max_new_tokens": 100, **kw})
    reqs, collected, deltas = _run([stream], [p], [[1, 2, 3]])
    return reqs[0], collected["0"], deltas


def test_stop_string_split_across_two_steps():
    req, got, deltas = _one([b"a", b"ST", b"OP", b"b"], stop=["STOP"])
    assert req.output_ids == [PIECES.index(b"a"), PIECES.index(b"ST"), PIECES.index(b"OP")]
    assert (got.finish_reason, got.matched_stop, got.stop_text) == ("stop", "STOP", "a")
    assert [d.finished for d in deltas] == [False, False, True]  # not finished after "ST"


def test_stop_string_spanning_three_tokens_and_the_earliest_wins():
    req, got, _ = _one([b"ab", b"c ", b" d", b"a", b"b"], stop=["b", "c  d"])  # "b" completes first
    assert (got.matched_stop, got.stop_text, req.num_output) == ("b", "a", 1)
    req, got, _ = _one([b"a", b"c ", b" d", b"a"], stop=["d", "c  d"])  # both end at " d": earlier start wins
    assert (got.matched_stop, got.stop_text, req.num_output) == ("c  d", "a", 3)


def test_stop_string_completed_by_a_character_split_across_tokens():
    req, got, _ = _one([b"a", b"xy\xe2", b"\x82\xac", b"b"], stop=["y€"])
    assert (got.matched_stop, got.stop_text, req.num_output) == ("y€", "ax", 3)
    req, got, _ = _one([b"a", b"xy\xe2", b"\x82\xac"], stop=["xy"])  # found while "€" is still incomplete
    assert (got.matched_stop, got.stop_text, req.num_output) == ("xy", "a", 2)


def test_eos_stop_token_and_ignore_eos():
    stream = [PIECES.index(b"a"), EOS, PIECES.index(b"b"), PIECES.index(b"S")]
    p = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=3, ignore_eos=True),
         SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[PIECES.index(b"b")])]
    reqs, collected, _ = _run([stream] * 3, p, [[5]] * 3)
    assert (reqs[0].output_ids, reqs[0].finish_reason, reqs[0].matched_stop) == (stream[:2], "stop", EOS)
    assert collected["0"].visible_ids() == stream[:1]  # the EOS is not part of the text
    assert (reqs[1].output_ids, reqs[1].finish_reason) == (stream[:3], "length")
    assert (reqs[2].output_ids, reqs[2].matched_stop) == (stream[:3], PIECES.index(b"b"))


def test_max_new_tokens_and_context_length():
    stream = [PIECES.index(b"a")] * 10
    p = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=50)]
    reqs, collected, _ = _run([stream, stream], p, [[1], [1] * (MAX_MODEL_LEN - 6)])
    assert reqs[0].num_output == 4 and collected["0"].finish_reason == "length"
    assert len(reqs[1].token_ids) == MAX_MODEL_LEN and collected["1"].finish_reason == "length"


def test_logprobs_only_when_asked_and_in_order():
    stream = [PIECES.index(b"a"), PIECES.index(b"b"), PIECES.index(b"ab")]
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, logprobs=True),
              SamplingParams(max_new_tokens=3, logprobs=True, top_logprobs=2)]
    _, _, deltas = _run([stream] * 3, params, [[1]] * 3)
    by_rid = {d.rid: d for d in deltas if d.new_token_ids == stream[:1]}
    assert by_rid["0"].new_logprobs is None and by_rid["0"].new_top_logprobs is None
    assert by_rid["1"].new_logprobs == [_lp(0, stream[0])] and by_rid["1"].new_top_logprobs is None
    assert by_rid["2"].new_top_logprobs == [_top(0, stream[0], 2)]


def test_prompt_logprobs_are_sent_once_after_the_last_chunk():
    proc = OutputProcessor(TOK, {EOS}, MAX_MODEL_LEN)
    req = Request.new("r", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2, prompt_logprobs=True))
    assert req.wants_prompt_logprobs
    proc.prompt_logprobs(req, torch.tensor([-1.0, -2.0]), final=False)
    assert proc.take() == [] and req.wants_prompt_logprobs
    proc.prompt_logprobs(req, torch.tensor([-3.0, -4.0]), final=True)
    proc.process([req], _result(0, [7], [req.params]))
    (d,) = proc.take()
    assert d.prompt_logprobs == [None, -1.0, -2.0, -3.0, -4.0] and d.new_token_ids == [7]
    assert not req.wants_prompt_logprobs
    proc.process([req], _result(1, [8], [req.params]))
    (d,) = proc.take()
    assert d.prompt_logprobs is None and d.finish_reason == "length"


def test_abort_sends_a_final_delta_and_later_tokens_are_discarded():
    proc = OutputProcessor(TOK, {EOS}, MAX_MODEL_LEN)
    req = Request.new("r", [1], SamplingParams(max_new_tokens=10))
    proc.process([req], _result(0, [3], [req.params]))
    proc.finish(req, "abort")
    proc.process([req], _result(1, [4], [req.params]))
    (d,) = proc.take()
    assert (d.new_token_ids, d.finish_reason) == ([3], "abort")
    assert req.output_ids == [3] and proc.take() == []


def test_without_emit_state_is_identical_and_no_deltas_are_made():
    rng = random.Random(7)
    cases = [_random_case(rng) for _ in range(30)]
    streams, params, prompts = (list(x) for x in zip(*cases))
    on, _, _ = _run(streams, params, prompts)
    off, collected, deltas = _run(streams, params, prompts, emit=False)
    assert deltas == [] and not any(c.output_ids for c in collected.values())
    for a, b in zip(on, off):
        assert (a.token_ids, a.finish_reason, a.matched_stop) == (b.token_ids, b.finish_reason, b.matched_stop)
