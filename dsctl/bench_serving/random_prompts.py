"""Random prompts of exact token lengths for `bench serving --dataset random`.

Three forms, best first:

- "ids": token ids (OpenAI's /v1/completions takes `prompt` as a list of ints).
  Exactly the length asked; nothing is decoded or re-tokenized on the way.
- "text": text whose token count is checked with the tokenizer and corrected
  until it matches (used for chat, and for servers that refuse token ids). On
  /v1/completions the count includes the BOS the server's tokenizer adds; on chat
  it is the message content's count (the chat template adds its own tokens).
- "words": no tokenizer at all: common English words, one per token asked. Only
  an approximation; the server's usage field gives the real count.

Ids are drawn from the tokenizer's ordinary tokens (never BOS, EOS or other
added tokens); text is built from tokens that stay one token when re-encoded.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

import numpy as np

from dsctl.bench_serving.tokens import TokenCounter
from engine.errors import UsageError

PromptForm = Literal["ids", "text", "words"]
FIX_ROUNDS = 8  # re-count and correct a text prompt at most this often
_WORD = re.compile(r" [A-Za-z]{2,}")
_LETTER = re.compile(r"[A-Za-z]")
_MIN_WORDS = 64  # a pool smaller than this falls back to single letters

# Without a tokenizer, random prompts are made of common words (about one token each).
WORDS = ("the of and to in is was for on are with as by at from that this have one which you were his her "
         "they had not but what all when there can more some time into them two then other about many out "
         "these so would make like him has look write see number way could people than first water been call "
         "who oil its now find long down day did get come made may part over new sound take only little work "
         "know place year live back give most very after thing our just name good sentence man think say great "
         "where help through much before line right too mean old any same tell boy follow came want show also "
         "around form three small set put end does another well large must big even such because turn here why "
         "ask went men read need land different home us move try kind hand picture again change off play spell "
         "air away animal house point page letter mother answer found study still learn should world").split()


def pick_form(endpoint: str, tok: Optional[TokenCounter]) -> PromptForm:
    if tok is None:
        return "words"
    return "ids" if endpoint == "completions" else "text"


def lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    """n lengths uniform in [length * ratio, length] (at least 1); ratio 1 gives exactly length."""
    if not 0.0 <= ratio <= 1.0:
        raise UsageError("--random-range-ratio must be within [0, 1]")
    low = max(1, int(length * ratio))
    return rng.integers(low, max(low, length) + 1, size=n)


def text_pool(tok: TokenCounter) -> np.ndarray:
    """Ids whose text stays the same single token when re-encoded, preferring " word" tokens
    (they never merge with their neighbours) over single letters (byte-level vocabularies)."""
    ids = tok.ordinary_ids
    texts = tok.decode_each(ids)
    for pattern, minimum in ((_WORD, _MIN_WORDS), (_LETTER, 1)):
        cands = [(int(i), t) for i, t in zip(ids, texts) if pattern.fullmatch(t)]
        if not cands:
            continue
        encoded = tok.encode_each([t for _, t in cands])
        pool = [i for (i, _), e in zip(cands, encoded) if e == [i]]
        if len(pool) >= minimum:
            return np.array(pool, dtype=np.int64)
    stable = [int(i) for i, e in zip(ids, tok.encode_each(texts)) if e == [int(i)]]
    if not stable:
        raise UsageError(f"tokenizer {tok.source} has no token that re-encodes to itself; "
                         "cannot build text prompts of a known length")
    return np.array(stable, dtype=np.int64)


class TextMaker:
    """Text of an exact token count: decode random pool tokens, count, add or drop tokens, repeat."""

    def __init__(self, tok: TokenCounter, add_special_tokens: bool):
        self.tok, self.special = tok, add_special_tokens
        self.pool = text_pool(tok)
        self.overhead = tok.count("", add_special_tokens)  # BOS the server will add, if any

    def make(self, rng: np.random.Generator, target: int) -> tuple[str, int]:
        """(text, its token count); the count equals target unless FIX_ROUNDS corrections were not enough."""
        ids = rng.choice(self.pool, size=max(0, target - self.overhead)).tolist()
        for _ in range(FIX_ROUNDS):
            text = self.tok.decode(ids)
            count = self.tok.count(text, self.special)
            if count == target:
                break
            if count > target:
                ids = ids[:max(0, len(ids) - (count - target))]
            else:
                ids += rng.choice(self.pool, size=target - count).tolist()
        else:
            text = self.tok.decode(ids)
            count = self.tok.count(text, self.special)
        return text, count


def random_prompts(rng: np.random.Generator, in_lens: np.ndarray, form: PromptForm,
                   tok: Optional[TokenCounter], add_special_tokens: bool = True) -> list:
    """One prompt of each asked length, in the given form (token ids or text)."""
    if form == "ids":
        pool = tok.ordinary_ids
        return [rng.choice(pool, size=int(n)).tolist() for n in in_lens]
    if form == "text":
        maker = TextMaker(tok, add_special_tokens)
        return [maker.make(rng, int(n))[0] for n in in_lens]
    return [" ".join(rng.choice(WORDS, size=int(n)).tolist()) for n in in_lens]
