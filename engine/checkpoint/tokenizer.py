"""Tokenizer loading (Hugging Face tokenizer.json + tokenizer_config.json, chat template)."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Callable, Optional

from engine.errors import UsageError


class Tokenizer:
    """Thin wrapper over a transformers fast tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, path: Path):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer  # lazy: transformers (seconds) loads only to load a tokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - surface as a user-facing error
            raise UsageError(f"cannot load the tokenizer from {path}: {exc}") from None
        # Decoding is on the per-token path (stop strings, streamed text): call the Rust tokenizer directly
        # when transformers' decode would add nothing to it (it converts and checks every id first).
        self._fast = getattr(self.hf, "_tokenizer", None) if not self._cleans_up() else None

    def _cleans_up(self) -> bool:
        """Whether transformers' decode post-processes the Rust tokenizer's text (clean_up_tokenization)."""
        hf = self.hf
        if not getattr(hf, "clean_up_tokenization_spaces", False):
            return False
        bpe = type(getattr(getattr(hf, "backend_tokenizer", None), "model", None)).__name__ == "BPE"
        return not bpe or bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                       False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None and type(ids) is list:
            return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_fn(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """`decode` with the option bound: for per-token callers (incremental detokenization)."""
        if self._fast is not None:
            return partial(self._fast.decode, skip_special_tokens=skip_special_tokens)
        return partial(self.decode, skip_special_tokens=skip_special_tokens)

    def stream_step(self, skip_special_tokens: bool = True) -> Optional[Callable[[int], Optional[str]]]:
        """A fresh incremental decoder for one sequence, in the Rust tokenizer (tokenizers' DecodeStream):
        step(token_id) -> the text that token completes, or None while it completes none (an incomplete
        character). None where there is no such fast path (`decode` post-processes, or an old tokenizers)."""
        if self._fast is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream  # lazy: loads with a tokenizer; needs tokenizers >= 0.21
        except ImportError:
            return None
        return partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._fast)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> list[int]:
        """The rendered conversation's token ids; `variables` reach the template (V3.1: thinking=True)."""
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **variables)
        return self.encode(text, add_special_tokens=False)

    def eos_ids(self) -> set[int]:
        return {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()


def load_tokenizer(path: Optional[Path]) -> Optional[Tokenizer]:
    if path is None or not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    return Tokenizer(path)
