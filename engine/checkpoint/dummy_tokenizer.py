"""A generated tokenizer for a model that has no tokenizer files (dummy weights of a registry model).

Built by engine/checkpoint/tiny_tokenizer.py (the same builder as the built-in tiny
models' tokenizer) at the model's vocabulary size, with the BOS/EOS ids of its
config and a DeepSeek-style chat template, so a dummy server accepts text
prompts and chat messages. Kept on disk under <cache root>/tokenizers/, named by
everything the files depend on, and written atomically: built once per machine
(about a quarter of a second for V3's 129,280 ids), then only loaded.
"""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint.cache import build_once, cache_root
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.tiny_tokenizer import write_tokenizer

FORMAT_VERSION = 1  # bump when the builder's output changes


def cache_name(cfg: ModelConfig) -> str:
    return (f"bytelevel-v{FORMAT_VERSION}-vocab{cfg.vocab_size}-bos{cfg.bos_token_id}-eos{cfg.eos_token_id}"
            f"-ctx{cfg.max_position_embeddings}")


def generated_tokenizer_dir(cfg: ModelConfig) -> Path:
    """The directory holding cfg's generated tokenizer (tokenizer.json + tokenizer_config.json), built on first use."""
    return build_once(cache_root() / "tokenizers" / cache_name(cfg), lambda tmp: write_tokenizer(tmp, cfg, pad=True))
