"""Incremental detokenization for streaming.

Tokens of a byte-level BPE can split one UTF-8 character (an accent, a CJK
character, an emoji) across several tokens; decoding them one at a time would
show U+FFFD replacement characters. `IncrementalDetokenizer` decodes a short
window of already-emitted context plus the new tokens, emits only the text the
window adds, and holds the tail back while it still ends in an incomplete
character. `flush()` releases whatever is left when the sequence ends. The
concatenation of everything it emits equals decoding the whole sequence at once.
"""

from __future__ import annotations

from typing import Optional

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # tokens of emitted context decoded again, so word-boundary spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens whose text has been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, self.skip_special)

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the newly complete text (may be empty)."""
        self.ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return the remaining text, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if not final and (len(now) <= len(before) or now.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or the last character is still incomplete
        delta = now[len(before):]
        self.read = len(self.ids)
        self.prefix = max(0, self.read - CONTEXT_TOKENS)
        self.text += delta
        return delta


def decode_token(tokenizer, token_id: int) -> str:
    """The text of one token on its own (for log-prob listings)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode([token_id], False)


def token_bytes(text: Optional[str]) -> list[int]:
    return list(text.encode("utf-8")) if text else []
