"""The DeepSeek tool-call parser: every format, whole and streamed, the stream split at every boundary."""

from __future__ import annotations

import json
import random

import pytest

from engine.server.tool_parser import ToolCallParser

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALLS = [("get_weather", {"city": "東京", "unit": "c"}), ("search", {"q": "a ```json\n<｜b｜>", "n": 3})]


def v3(name, args):
    return f"{CB}function{SEP}{name}\n```json\n{json.dumps(args, ensure_ascii=False)}\n```{CE}"


def v31(name, args):
    return f"{CB}{name}{SEP}{json.dumps(args, ensure_ascii=False)}{CE}"


CASES = {  # format -> [(output text, expected content, expected [(name, args)])]
    "deepseek-v3": [
        ("Let me check. " + B + v3(*CALLS[0]) + "\n" + v3(*CALLS[1]) + E, "Let me check. ", CALLS),
        (B + v3(*CALLS[1]) + E + "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>", CALLS[1:]),
        ("no tools here <｜tool▁ but text", "no tools here <｜tool▁ but text", []),
    ],
    "deepseek-v3.1": [
        ("Sure" + B + v31(*CALLS[0]) + v31(*CALLS[1]) + E, "Sure", CALLS),
        (B + v31(*CALLS[0]) + E, "", CALLS[:1]),
        ("plain answer", "plain answer", []),
    ],
}


def _streamed(fmt: str, pieces: list[str]) -> tuple[str, list[dict]]:
    p = ToolCallParser(fmt)
    content, calls = "", []
    for k, piece in enumerate(pieces):
        text, deltas = p.feed(piece, final=k == len(pieces) - 1)
        content += text
        for d in deltas:
            entry = d.openai()
            if "id" in entry:  # a call's first delta: index, id, type, name (arguments may start in it)
                assert d.index == len(calls) and entry["type"] == "function" and entry["id"].startswith("call_")
                calls.append({"name": entry["function"]["name"], "arguments": entry["function"]["arguments"]})
            else:
                assert set(entry) == {"index", "function"} and entry["function"]["arguments"]
                calls[d.index]["arguments"] += entry["function"]["arguments"]
    return content, calls


def _expected(calls):
    return [{"name": n, "arguments": a} for n, a in calls]


def _check(content, calls, want_content, want_calls):
    assert content == want_content
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == _expected(want_calls)


@pytest.mark.parametrize("fmt", list(CASES))
def test_whole_output(fmt):
    for text, want_content, want_calls in CASES[fmt]:
        content, calls = ToolCallParser(fmt).parse(text)
        _check(content, calls, want_content, want_calls)
        assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("fmt", list(CASES))
def test_split_at_every_boundary(fmt):
    """Two pieces at every split point (every UTF-8 character boundary of the text), then one character at a
    time, then random splits into several pieces: always the whole output's content and calls."""
    rng = random.Random(0)
    for text, want_content, want_calls in CASES[fmt]:
        splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), 5))
            splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
        for pieces in splits:
            _check(*_streamed(fmt, pieces), want_content, want_calls)


def test_unfinished_block_keeps_what_was_read():
    text = "x" + B + v3(*CALLS[0]) + CB + "function" + SEP + "search\n```json\n{\"q\": \"ab"
    content, calls = ToolCallParser("deepseek-v3").parse(text)
    assert content == "x" and [c["name"] for c in calls] == ["get_weather", "search"]
    assert calls[1]["arguments"] == '{"q": "ab'


class _ByteTokenizer:
    """The built-in byte-level tokenizer (one token per UTF-8 byte) as the detokenizer sees a tokenizer."""

    def __init__(self):
        from engine.checkpoint.tiny_tokenizer import build_tokenizer

        self.tok = build_tokenizer(0, 1)

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("fmt", list(CASES))
def test_streamed_a_byte_at_a_time_through_the_detokenizer(fmt):
    """Every UTF-8 byte a token of its own (EOS apart; the markers and the CJK text are multi-byte): the text deltas
    the server's incremental detokenizer makes of them, fed to the parser, give the whole output's calls."""
    from engine.scheduler.detokenizer import IncrementalDetokenizer

    tok = _ByteTokenizer()
    for text, want_content, want_calls in CASES[fmt]:
        ids = tok.tok.encode(text, add_special_tokens=False).ids
        assert len(ids) >= len(text)  # a multi-byte character spans several tokens (EOS is one token)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
        pieces = [detok.push([i]) for i in ids] + [detok.flush()]
        _check(*_streamed(fmt, pieces), want_content, want_calls)
