"""Token counting for the benchmark: a `tokenizers` tokenizer when one is found, else estimates.

The server's usage fields are preferred everywhere; this is the fallback, and the
source of exact random prompts (random token ids decoded to text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.errors import UsageError


@dataclass
class TokenCounter:
    tokenizer: object  # tokenizers.Tokenizer
    source: str

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=False)


def estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer (about 1.3 tokens per English word)."""
    return max(1, round(len(text.split()) * 1.3))


def _tokenizer_file(spec: str) -> Optional[Path]:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None
    from engine.models import lookup

    entry = lookup(spec)
    repo_id = entry.repo_id if entry is not None else (spec if spec.count("/") == 1 else None)
    if repo_id is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "tokenizer.json")
    return Path(cached) if isinstance(cached, str) else None


def load_tokenizer(spec: Optional[str], required: bool) -> Optional[TokenCounter]:
    """The tokenizer named by spec (file, directory, alias or cached repo); None when not found."""
    if not spec:
        return None
    file = _tokenizer_file(spec)
    if file is None:
        if required:
            raise UsageError(f"no tokenizer.json found for --tokenizer {spec!r} "
                             "(give a file, a checkpoint directory, or a repo in the local HF cache)")
        return None
    from tokenizers import Tokenizer

    return TokenCounter(Tokenizer.from_file(str(file)), str(file))
