"""A generated tokenizer for a model that has no tokenizer files (dummy weights of a registry model).

Built by engine/weights/tiny_tokenizer.py (the same builder as the built-in tiny
models' tokenizer) at the model's vocabulary size, with the BOS/EOS ids of its
config and a DeepSeek-style chat template, so a dummy server accepts text
prompts and chat messages. Kept on disk under <cache root>/tokenizers/, named by
everything the files depend on, and written atomically: built once per machine
(about a quarter of a second for V3's 129,280 ids), then only loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.cache import cache_root
from engine.config import ModelConfig

FORMAT_VERSION = 1  # bump when the builder's output changes


def cache_name(cfg: ModelConfig) -> str:
    return (f"bytelevel-v{FORMAT_VERSION}-vocab{cfg.vocab_size}-bos{cfg.bos_token_id}-eos{cfg.eos_token_id}"
            f"-ctx{cfg.max_position_embeddings}")


def generated_tokenizer_dir(cfg: ModelConfig) -> Path:
    """The directory holding cfg's generated tokenizer (tokenizer.json + tokenizer_config.json), built on first use."""
    from engine.weights.tiny_tokenizer import write_tokenizer

    target = cache_root() / "tokenizers" / cache_name(cfg)
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=target.parent))
    try:
        write_tokenizer(tmp, cfg, pad=True)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first, or a stale incomplete copy is in the way
            if not (target / ".complete").is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
