"""The benchmark's tokenizer (a `tokenizers` tokenizer when one is found) and token estimates without one.

It supplies the ids of random token-id prompts, verifies the length of random
text prompts, and counts tokens when the server reports no usage. A registry
alias (`deepseek-v3`, `tiny`, ...) gets the tokenizer a dummy server of that
model uses: the checkpoint's when it is in the local Hugging Face cache, else the
stand-in dsctl generates at the model's vocab size (engine/checkpoint/dummy_tokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from huggingface_hub import try_to_load_from_cache
from tokenizers import Tokenizer

from engine.checkpoint.resolve import registry_tokenizer
from engine.errors import UsageError


@dataclass
class TokenCounter:
    tokenizer: object  # tokenizers.Tokenizer
    source: str

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        return self.tokenizer.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)

    def encode_each(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    @cached_property
    def ordinary_ids(self) -> np.ndarray:
        """Every id of the vocabulary except added tokens (BOS, EOS, chat markers, <think>, ...)."""
        added = set(self.tokenizer.get_added_tokens_decoder())
        ids = self.tokenizer.get_vocab(with_added_tokens=False).values()
        return np.array(sorted(i for i in ids if i not in added), dtype=np.int64)


def estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer (about 1.3 tokens per English word)."""
    return max(1, round(len(text.split()) * 1.3))


def _tokenizer_file(spec: str) -> Optional[tuple[Path, str]]:
    path = Path(spec).expanduser()
    if path.is_file():
        return path, str(path)
    if path.is_dir():
        return (path / "tokenizer.json", str(path)) if (path / "tokenizer.json").is_file() else None
    found = registry_tokenizer(spec)
    if found is not None:
        directory, source = found
        if (directory / "tokenizer.json").is_file():
            what = "checkpoint" if source == "checkpoint" else "generated stand-in"
            return directory / "tokenizer.json", f"{spec} ({what}, {directory})"
        return None
    if spec.count("/") != 1:
        return None
    cached = try_to_load_from_cache(spec, "tokenizer.json")
    return (Path(cached), f"{spec} ({cached})") if isinstance(cached, str) else None


def load_tokenizer(spec: Optional[str], required: bool) -> Optional[TokenCounter]:
    """The tokenizer named by spec (file, directory, registry alias or cached repo); None when not found."""
    if not spec:
        return None
    found = _tokenizer_file(spec)
    if found is None:
        if required:
            raise UsageError(f"no tokenizer.json found for --tokenizer {spec!r} "
                             "(give a file, a checkpoint directory, a registry alias or a repo in the local HF cache)")
        return None
    file, source = found
    return TokenCounter(Tokenizer.from_file(str(file)), source)


def first_tokenizer(names: Sequence[Optional[str]]) -> Optional[TokenCounter]:
    """The tokenizer of the first name that has one (model names the server reports, say)."""
    for name in names:
        tok = load_tokenizer(name, required=False)
        if tok is not None:
            return tok
    return None
