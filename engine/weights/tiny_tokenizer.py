"""The built-in models' tokenizer: byte-level BPE (one token per byte) plus DeepSeek's special tokens.

Written with the `tokenizers` library as tokenizer.json, with a
tokenizer_config.json carrying a DeepSeek-style chat template, so the engine
loads it exactly like a real DeepSeek checkpoint's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers import AddedToken

from engine.config import ModelConfig

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>"]
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


def build_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer(directory: Path, cfg: ModelConfig) -> None:
    tok = build_tokenizer()
    if tok.token_to_id(BOS) != cfg.bos_token_id or tok.token_to_id(EOS) != cfg.eos_token_id:
        raise ValueError("tiny config's bos/eos ids do not match the built-in tokenizer")
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError("built-in tokenizer is larger than the tiny model's vocabulary")
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
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
