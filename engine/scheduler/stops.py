"""Incremental stop-string matching over a request's growing output text.

Each new token is detokenized incrementally (engine/scheduler/detokenizer.py);
the search looks only at the new text (including text held back for an
incomplete character, as a full decode would show it) plus a tail of the older
text one character shorter than the longest stop string. So a stop string that
spans token (or step) boundaries is found the step it completes, the cost per
token does not grow with the output, and the result is the one a full decode of
the output after every token would give: a match earlier than the tail would
have been found before, so the earliest match in the window is the earliest in
the whole text.
"""

from __future__ import annotations

from typing import Optional

from engine.scheduler.detokenizer import IncrementalDetokenizer


class StopStrings:
    def __init__(self, stops: list[str], tokenizer, skip_special_tokens: bool):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.older: list[str] = []  # text before the tail, in pieces
        self.tail = ""  # the last `keep` characters of the text emitted by the detokenizer

    def push(self, token_id: int, match: bool = True) -> Optional[tuple[str, str]]:
        """Add one token; on a match return (the stop string, the whole text before it). With match off
        (before min_tokens) the text is only recorded; a stop string that ends later is still found."""
        detok = self.detok
        new = detok.push_one(token_id)
        held = detok.held
        if not new and not held:
            return None  # no text (a skipped special token)
        window = self.tail + new + held
        hits = [(window.find(s), s) for s in self.stops if s in window] if match else []
        if hits:
            pos, stop = min(hits)
            return stop, "".join(self.older) + window[:pos]
        window = self.tail + new  # held text is decoded again with the next token
        cut = max(0, len(window) - self.keep)
        if cut:
            self.older.append(window[:cut])
        self.tail = window[cut:]
        return None
