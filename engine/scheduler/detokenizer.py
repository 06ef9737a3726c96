"""Incremental detokenization: the text that each new token adds, without decoding the whole output.

Tokens of a byte-level BPE can split one UTF-8 character (an accent, a CJK
character, an emoji) across several tokens; decoding them one at a time would
show U+FFFD replacement characters. `IncrementalDetokenizer` decodes a short
window of already-emitted context plus the new tokens, emits only the text the
window adds, and holds the tail back while it still ends in an incomplete
character. `flush()` releases whatever is left when the sequence ends. The
concatenation of everything it emits equals decoding the whole sequence at once.

`held` is the text decoded but held back (it ends in an incomplete character, as
a full decode would show it). It keeps only that window (a few tokens), never the
whole text: callers keep what they need. The text of the emitted context is kept
from the previous call, so a token costs one decode of at most 2 * CONTEXT_TOKENS
+ 1 tokens (plus one more each time the window is cut back to CONTEXT_TOKENS). Used by the output processor for stop strings (engine process) and by
the server for streamed text (serving process), where `text_stream` hands out a `StreamDetokenizer` when the
tokenizer has a Rust incremental decoder (the same text, about a third of the time per token).
"""

from __future__ import annotations

from typing import Callable, Optional

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # at least this many tokens of emitted context are decoded again (word-boundary spaces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer  # anything with decode(ids, skip_special_tokens) -> str, or None
        self.skip_special = skip_special_tokens
        # engine.checkpoint.tokenizer.Tokenizer hands out its fastest decode for this setting (one call per token)
        fn = getattr(tokenizer, "decode_fn", None)
        self._decode_ids = fn(skip_special_tokens) if fn is not None else None
        self.window: list[int] = []  # emitted context, then the tokens whose text is not emitted yet
        self.read = 0  # window[:read] is emitted context
        self.held = ""  # text of window[read:] held back (ends in U+FFFD), or ""
        self._read_text = ""  # decode(window[:read])

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        if self._decode_ids is not None:
            return self._decode_ids(ids)
        return self.tokenizer.decode(ids, self.skip_special)

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the newly complete text (may be empty)."""
        self.window.extend(ids)
        return self._advance(final=False)

    def push_one(self, token_id: int) -> str:
        """`push([token_id])` (the per-token path of stop strings, without building a list)."""
        self.window.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return the remaining text, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self.window
        if self.read == len(window):
            return ""
        before = self._read_text
        decode = self._decode_ids or self._decode  # (window is not empty here)
        now = decode(window)
        if not final and (len(now) <= len(before) or now.endswith(REPLACEMENT)):
            self.held = now[len(before):]
            return ""  # nothing new yet, or the last character is still incomplete
        self.held = ""
        if len(window) > 2 * CONTEXT_TOKENS:
            window = self.window = window[-CONTEXT_TOKENS:]
            now_read = decode(window)
        else:
            now_read = now
        self.read, self._read_text = len(window), now_read
        return now[len(before):]

    @classmethod
    def resumed(cls, tokenizer, skip_special_tokens: bool, context: list[int],
                pending: list[int]) -> "IncrementalDetokenizer":
        """One that carries on a sequence whose text up to `context` (the last emitted ids) was emitted and
        whose `pending` ids were not."""
        detok = cls(tokenizer, skip_special_tokens)
        detok.window, detok.read = [*context, *pending], len(context)
        detok._read_text = detok._decode(context)
        return detok


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s push / flush for streamed text, each token decoded by the tokenizer's own
    incremental decoder (`step`: Tokenizer.stream_step). Keeps the last emitted ids and the ids not emitted yet,
    for `flush` (the decoder has no flush) and for going on in Python should the decoder refuse a text (it
    raises when a decode does not extend the text before it)."""

    def __init__(self, tokenizer, skip_special_tokens: bool, step: Callable[[int], Optional[str]]):
        self.tokenizer, self.skip_special, self._step = tokenizer, skip_special_tokens, step
        self.context: list[int] = []  # the last emitted ids (a few), the context of a flush
        self.pending: list[int] = []  # ids whose text is not emitted yet
        self._python: Optional[IncrementalDetokenizer] = None  # after the decoder refused a text

    def push(self, ids: list[int]) -> str:
        if self._python is not None:
            return self._python.push(ids)
        out = ""
        for i, token_id in enumerate(ids):
            try:
                text = self._step(token_id)
            except Exception:  # noqa: BLE001 - the decoder's "invalid prefix": the Python window takes over
                self._python = IncrementalDetokenizer.resumed(self.tokenizer, self.skip_special, self.context,
                                                              self.pending)
                return out + self._python.push(ids[i:])
            if text is None:
                self.pending.append(token_id)
                continue
            out += text
            context = self.context
            context += self.pending
            context.append(token_id)
            self.pending = []
            if len(context) > 2 * CONTEXT_TOKENS:
                del context[:-CONTEXT_TOKENS]
        return out

    def flush(self) -> str:
        if self._python is not None:
            return self._python.flush()
        if not self.pending:
            return ""
        return IncrementalDetokenizer.resumed(self.tokenizer, self.skip_special, self.context, self.pending).flush()


def text_stream(tokenizer, skip_special_tokens: bool = True):
    """The detokenizer for one streamed sequence: the tokenizer's incremental decoder where it has one."""
    make = getattr(tokenizer, "stream_step", None)
    step = make(skip_special_tokens) if make is not None else None
    if step is None:
        return IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return StreamDetokenizer(tokenizer, skip_special_tokens, step)
