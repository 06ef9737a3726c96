"""The serving process's text machinery on its own (no server): reasoning split, detokenizer, stop holdback."""

from __future__ import annotations

import random

import pytest

from engine.runtime.protocol import RequestOutput
from engine.sampling import SamplingParams
from engine.scheduler.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from engine.server.generation import Sequence
from engine.server.reasoning import ReasoningParser


class ByteTokenizer:
    """Token id = one UTF-8 byte; decoding shows incomplete characters as U+FFFD, like a byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


REASONING_CASES = [
    ("<think>weigh the options</think>The answer is 4.", "weigh the options", "The answer is 4."),
    ("no opening tag</think>content", "no opening tag", "content"),
    ("never closed <thi", "never closed <thi", ""),
    ("</think>only content", "", "only content"),
    ("<think></think>", "", ""),
    ("a < b and </ c</think>x</think>y", "a < b and </ c", "x</think>y"),
]


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_parser_whole_text(text, reasoning, content):
    assert ReasoningParser("deepseek-r1").parse(text) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_parser_streamed_in_any_chunks_equals_whole(text, reasoning, content):
    rng = random.Random(len(text))
    for _trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        parser, got_r, got_c = ReasoningParser("deepseek-r1"), "", ""
        for i, piece in enumerate(pieces):
            r, c = parser.feed(piece, final=i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
            assert "</think>" not in got_r  # a split tag never leaks into the reasoning
        assert (got_r, got_c) == (reasoning, content), pieces


def test_unknown_reasoning_parser_is_rejected():
    with pytest.raises(ValueError):
        ReasoningParser("nope")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "数学 🙂 mixed ✓ end", "🙂🙂🙂"])
def test_detokenizer_never_emits_partial_characters(text):
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([b]) for b in tok.encode(text)] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(detok.window) <= 2 * CONTEXT_TOKENS  # only a few tokens of context are kept, never the whole text


def test_detokenizer_flush_releases_a_truncated_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("ok 🙂")[:-1]  # the emoji is cut off
    emitted = "".join(detok.push([b]) for b in ids)
    assert emitted == "ok "
    assert detok.flush() == tok.decode(ids)[len("ok "):]


def test_sequence_holds_back_possible_stop_text_and_cuts_at_the_stop():
    tok = ByteTokenizer()
    params = SamplingParams(stop=["STOP"], max_new_tokens=100)
    seq = Sequence([1, 2], params, tok)
    out_text = "answer is 42 ST"  # "ST" could start "STOP": it must not be shown yet
    deltas = [seq.apply(RequestOutput("r", new_token_ids=[b])) for b in tok.encode(out_text)]
    assert "".join(deltas) == "answer is 42 "[:len("".join(deltas))]
    assert not "".join(deltas).endswith("S")
    final = seq.apply(RequestOutput("r", new_token_ids=tok.encode("OP"), finish_reason="stop", matched_stop="STOP",
                                    stop_text="answer is 42 "))
    assert "".join(deltas) + final == "answer is 42 " == seq.text
    assert seq.finish_reason == "stop" and seq.matched_stop == "STOP"


def test_sequence_drops_the_eos_token_text():
    tok = ByteTokenizer()
    seq = Sequence([1], SamplingParams(max_new_tokens=10), tok)
    text = seq.apply(RequestOutput("r", new_token_ids=tok.encode("hi")))
    text += seq.apply(RequestOutput("r", new_token_ids=[ord("!")], finish_reason="stop", matched_stop=ord("!")))
    assert text == "hi" and seq.output_ids == tok.encode("hi!")
