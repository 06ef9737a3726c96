"""The byte-level tokenizer dsctl builds itself: for the built-in models and for models with no tokenizer files.

One token per byte (byte-level BPE with no merges, so any text round-trips
exactly), DeepSeek's special tokens at the ids the model's config names, and,
when asked, filler tokens up to the model's vocabulary size (a model with random
weights emits any id, so every id must decode to some text). Written with the
`tokenizers` library as tokenizer.json plus a tokenizer_config.json carrying a
DeepSeek-style chat template, so the engine loads it exactly like a real
DeepSeek checkpoint's tokenizer. The layout depends only on (vocab size, BOS id,
EOS id), so every machine builds the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.checkpoint.config import ModelConfig

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL = [BOS, EOS, USER, ASSISTANT]
PLAIN_ADDED = ["<think>", "</think>"]

# System prompt first, then turns; assistant turns end with EOS; R1-style models may
# emit <think>...</think> which the server's reasoning parser separates.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte value 0..255 (GPT-2 byte-level scheme)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def filler(token_id: int, alphabet: list[str]) -> str:
    """The filler token at token_id, in byte-level form: it decodes to the text " t<id>"."""
    return "".join(alphabet[b] for b in f" t{token_id}".encode())


def token_strings(bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> list[str]:
    """The token of every id: BOS and EOS at their ids, then the 256 bytes, the chat markers and the
    <think> tags in the free ids in order, then (up to vocab_size, if given) fillers."""
    if bos_id is not None and bos_id == eos_id:
        raise ValueError(f"BOS and EOS share the id {bos_id}")
    fixed = {i: t for i, t in ((bos_id, BOS), (eos_id, EOS)) if i is not None}
    alphabet = byte_alphabet()
    queue = alphabet + [t for t in SPECIAL if t not in fixed.values()] + PLAIN_ADDED
    needed = max(len(queue) + len(fixed), *(i + 1 for i in fixed))
    size = vocab_size if vocab_size is not None else needed
    if size < needed:
        raise ValueError(f"a vocabulary of {size} cannot hold the {needed} ids this tokenizer needs "
                         f"(256 bytes, special tokens, BOS id {bos_id}, EOS id {eos_id})")
    tokens, pending = [], iter(queue)
    for i in range(size):
        tokens.append(fixed.get(i) or next(pending, None) or filler(i, alphabet))
    return tokens


def build_tokenizer(bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                    vocab_size: Optional[int] = None) -> Tokenizer:
    """The byte-level tokenizer for these ids; vocab_size pads it with fillers to exactly that size."""
    tokens = token_strings(bos_id, eos_id, vocab_size)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    return tok


def write_tokenizer(directory: Path, cfg: ModelConfig, pad: bool = False) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json for cfg into directory.

    pad: fill the vocabulary up to cfg.vocab_size with fillers (the built-in tiny models do
    not, so their tokenizer keeps the 262 tokens it has always had).
    """
    tok = build_tokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size if pad else None)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"the generated tokenizer ({tok.get_vocab_size()} tokens) is larger than the "
                         f"model's vocabulary ({cfg.vocab_size})")
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    gen = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
