"""Reasoning parsers: split a model's `<think>…</think>` section from its answer.

`deepseek-r1`: R1's chat template opens the thinking section itself, so the
output starts in reasoning mode: everything up to `</think>` is reasoning (a
leading `<think>` the model writes itself is dropped), everything after it is
content. An output that never closes the section is all reasoning.
`deepseek-v3.1`: V3.1 (and -Terminus) think only when the request passes
`chat_template_kwargs: {"thinking": true}` (the template then opens the
section); then it is parsed as R1's, else the whole output is content. The parser
is fed text deltas and returns (reasoning delta, content delta); it holds back
a tail that could be the start of a tag, so streamed and whole-text results
are identical.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek-r1", "deepseek-v3.1")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, name: str = "deepseek-r1", thinking: bool = False):
        """thinking: the request's chat_template_kwargs `thinking` (read by deepseek-v3.1 only)."""
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        self.in_reasoning = name == "deepseek-r1" or thinking
        self.at_start = self.in_reasoning  # a leading <think> may still arrive
        self.buf = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Consume a text delta; return (reasoning, content) ready to emit."""
        self.buf += delta
        if not self.in_reasoning:
            out, self.buf = self.buf, ""
            return "", out
        if self.at_start:
            if START.startswith(self.buf) and not final:
                return "", ""  # could still become <think>
            if self.buf.startswith(START):
                self.buf = self.buf[len(START):]
            self.at_start = False
        end = self.buf.find(END)
        if end >= 0:
            reasoning, content = self.buf[:end], self.buf[end + len(END):]
            self.buf, self.in_reasoning = "", False
            return reasoning, content
        keep = 0 if final else _partial_suffix(self.buf, END)
        reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return reasoning, ""

    def parse(self, text: str) -> tuple[str, str]:
        """Split a whole output at once."""
        return self.feed(text, final=True)
