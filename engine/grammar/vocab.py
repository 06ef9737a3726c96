"""The vocabulary as xgrammar sees it (`xgr.TokenizerInfo`), aligned with what the engine's detokenizer shows.

xgrammar's detection (`TokenizerInfo.from_huggingface`) gives the vocabulary's encoding (byte-level for the
DeepSeek tokenizers and dsctl's generated one) and whether a space is prepended. It takes every token's text
from the vocabulary, special tokens included: it would let a grammar spell `<｜User｜>` inside a JSON string,
while the detokenizer (skip_special_tokens, the default) drops that token. Here the special tokens get no
text, which xgrammar reads as "special": never allowed by a grammar (the stop tokens still end one).
"""

from __future__ import annotations

import xgrammar as xgr


def special_ids(hf) -> set[int]:
    """The ids the detokenizer drops with skip_special_tokens (the tokenizer's special added tokens)."""
    return {i for i, tok in hf.added_tokens_decoder.items() if tok.special}


def tokenizer_info(hf, vocab_size: int, stop_ids: set[int]) -> xgr.TokenizerInfo:
    """The TokenizerInfo of a transformers tokenizer `hf` for a model whose logits are `vocab_size` wide."""
    stops = sorted(stop_ids) or None
    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    for i in special_ids(hf):
        if i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=detected.stop_token_ids, add_prefix_space=detected.add_prefix_space)
