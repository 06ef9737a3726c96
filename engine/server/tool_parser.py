"""Tool calls read back from a DeepSeek model's output, whole or streamed (formats: engine/grammar/tool_calls.py).

`ToolCallParser(fmt).feed(text_delta, final)` returns (content delta, [ToolCallDelta]): the text outside the
tool-call block goes to content; each call is announced once with its index, a fresh id and its name, then
its arguments follow in fragments as they arrive (the OpenAI streaming shape). A tail that could still turn
into a marker is held back, so any split of the output gives the same content and the same calls as the
whole text at once (`parse`). An unfinished block at the end keeps what was read of it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
JSON_OPEN, JSON_CLOSE = "\n```json\n", "\n```"  # deepseek-v3 wraps the arguments in a fenced block
FORMATS = ("deepseek-v3", "deepseek-v3.1")


@dataclass
class ToolCallDelta:
    index: int
    id: Optional[str] = None  # set (with name) on a call's first delta only
    name: Optional[str] = None
    arguments: str = ""

    def openai(self) -> dict:
        """The delta as an OpenAI `tool_calls` entry of a streamed chunk."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, *markers: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ToolCallParser:
    def __init__(self, fmt: str = "deepseek-v3"):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.v3 = fmt == "deepseek-v3"
        self.args_end = JSON_CLOSE + CALL_END if self.v3 else CALL_END
        self.buf, self.state, self.index = "", "text", -1
        self.calls: list[dict] = []  # whole calls so far: {"id", "name", "arguments"}

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.buf += delta
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        step = {"text": self._text, "calls": self._calls, "header": self._header, "args": self._args}
        while step[self.state](content, calls, final):
            pass
        for d in calls:
            if d.id is not None:
                self.calls.append({"id": d.id, "name": d.name, "arguments": ""})
            self.calls[d.index]["arguments"] += d.arguments
        return "".join(content), calls

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """A whole output: (content, [{"id", "name", "arguments"}])."""
        content, _ = self.feed(text, final=True)
        return content, self.calls

    # each state consumes what it can; True when it moved on to another state (run again)
    def _text(self, content: list[str], calls, final: bool) -> bool:
        i = self.buf.find(CALLS_BEGIN)
        if i >= 0:
            content.append(self.buf[:i])
            self.buf, self.state = self.buf[i + len(CALLS_BEGIN):], "calls"
            return True
        keep = 0 if final else _held(self.buf, CALLS_BEGIN)
        content.append(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _calls(self, content, calls, final: bool) -> bool:
        rest = self.buf.lstrip()
        for marker, state in ((CALL_BEGIN, "header"), (CALLS_END, "text")):
            if rest.startswith(marker):
                self.buf, self.state = rest[len(marker):], state
                return True
        if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
            return False  # nothing yet, or the start of a marker
        self.state = "text"  # not a call: the rest is text
        return True

    def _header(self, content, calls: list[ToolCallDelta], final: bool) -> bool:
        sep = self.buf.find(SEP)
        if sep < 0:
            return self._unfinished(final)
        if self.v3:  # TYPE<sep>NAME + JSON_OPEN
            end = self.buf.find(JSON_OPEN, sep)
            if end < 0:
                return self._unfinished(final)
            name, rest = self.buf[sep + len(SEP):end], self.buf[end + len(JSON_OPEN):]
        else:  # NAME<sep>
            name, rest = self.buf[:sep], self.buf[sep + len(SEP):]
        self.index += 1
        calls.append(ToolCallDelta(self.index, new_call_id(), name.strip()))
        self.buf, self.state = rest, "args"
        return True

    def _unfinished(self, final: bool) -> bool:
        if final:  # a header cut off at the end: no call
            self.buf, self.state = "", "text"
        return False

    def _args(self, content, calls: list[ToolCallDelta], final: bool) -> bool:
        i = self.buf.find(self.args_end)
        if i >= 0:
            self._fragment(calls, self.buf[:i])
            self.buf, self.state = self.buf[i + len(self.args_end):], "calls"
            return True
        keep = 0 if final else _held(self.buf, self.args_end)
        self._fragment(calls, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _fragment(self, calls: list[ToolCallDelta], text: str) -> None:
        if not text:
            return
        if calls and calls[-1].index == self.index:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(self.index, arguments=text))
