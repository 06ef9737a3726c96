"""Grammars over Unicode scalar values only: xgrammar's character classes admit the surrogate code points
U+D800..U+DFFF (their 3-byte forms ED A0..BF xx), which are not UTF-8. A model with byte tokens can then write
e.g. ED A0 80 inside a JSON string, and the detokenizer shows it as three U+FFFD (xgrammar counts it as one
character, so even `maxLength` breaks). `scalar_only(ebnf)` rewrites the character classes of a printed
grammar (`str(xgr.Grammar)`) so that none of them matches a surrogate: a negated class excludes the range,
a positive class that spans it is split around it. Everything outside character classes is left as it is.
"""

from __future__ import annotations

SURROGATES = (0xD800, 0xDFFF)
_EXCLUDE = r"\ud800-\udfff"
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "b": "\b", "e": "\x1b"}
_HEX = {"x": 2, "u": 4, "U": 8}


def _char(text: str, i: int) -> tuple[int, int]:
    """The code point of the (escaped or plain) class character at text[i], and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    c = text[i + 1]
    if c in _HEX:
        n = _HEX[c]
        return int(text[i + 2:i + 2 + n], 16), i + 2 + n
    return ord(_SIMPLE.get(c, c)), i + 2


def _ranges(body: str) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(body):
        lo, i = _char(body, i)
        hi = lo
        if i + 1 < len(body) and body[i] == "-":
            hi, i = _char(body, i + 1)
        out.append((lo, hi))
    return out


def _positive(body: str) -> str:
    """A positive class body without the surrogates (unchanged unless one of its ranges reaches them)."""
    ranges = _ranges(body)
    lo_s, hi_s = SURROGATES
    if not any(lo <= hi_s and hi >= lo_s for lo, hi in ranges):
        return body
    kept = []
    for lo, hi in ranges:
        kept += [(a, b) for a, b in ((lo, min(hi, lo_s - 1)), (max(lo, hi_s + 1), hi)) if a <= b]
    return "".join(rf"\U{a:08x}" if a == b else rf"\U{a:08x}-\U{b:08x}" for a, b in kept)


def _class_end(text: str, i: int) -> int:
    """The index of the `]` closing the class whose body starts at text[i]."""
    while text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i


def _string_end(text: str, i: int) -> int:
    """The index after the string literal opening at text[i] (a `"`)."""
    i += 1
    while text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i + 1


def scalar_only(ebnf: str) -> str:
    """ebnf (xgrammar's printed form) with no character class matching a surrogate code point."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':
            end = _string_end(ebnf, i)
            out.append(ebnf[i:end])
            i = end
        elif c == "[":
            negated = ebnf.startswith("[^", i)
            start = i + 2 if negated else i + 1
            end = _class_end(ebnf, start)
            body = ebnf[start:end]
            out.append(f"[^{body}{_EXCLUDE}]" if negated else f"[{_positive(body) if body else body}]")
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)
