"""Tokenizer loading (Hugging Face tokenizer.json + tokenizer_config.json, chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.errors import UsageError


class Tokenizer:
    """Thin wrapper over a transformers fast tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, path: Path):
        import os

        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - surface as a user-facing error
            raise UsageError(f"cannot load the tokenizer from {path}: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def eos_ids(self) -> set[int]:
        return {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()


def load_tokenizer(path: Optional[Path]) -> Optional[Tokenizer]:
    if path is None or not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    return Tokenizer(path)
