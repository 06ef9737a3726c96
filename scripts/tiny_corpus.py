"""The training corpus of the `tiny-py` model: the Python standard library's own source files.

Every machine with Python has them. Files: every `*.py` under the running interpreter's stdlib
directory (sysconfig's "stdlib" path), except site-packages and test directories, in sorted order
of their path relative to that directory. The held-out split is by file: a file is held out when
crc32 of its relative path is 0 mod HELD_OUT_MOD, so the split of a given file does not depend
on the Python version or on which other files exist.

Tokens are bytes: the byte-level tokenizer of engine/checkpoint/tiny_tokenizer.py maps byte b to id b
(BOS / EOS at 256 / 257); each file is BOS + its UTF-8 bytes + EOS.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

HELD_OUT_MOD = 20  # about 5% of the files
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
BOS_ID, EOS_ID = 256, 257


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> list[str]:
    """Relative paths (posix) of the corpus files under root, sorted."""
    root = root or stdlib_dir()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or not f.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


def split_files(root: Optional[Path] = None) -> tuple[list[str], list[str]]:
    """(train files, held-out files), both sorted."""
    files = stdlib_files(root)
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def encode_files(files: list[str], root: Optional[Path] = None) -> np.ndarray:
    """One int64 token stream: BOS + bytes + EOS of each file, in the given order."""
    root = root or stdlib_dir()
    parts = []
    for rel in files:
        data = np.frombuffer((root / rel).read_bytes(), dtype=np.uint8).astype(np.int64)
        parts.extend([np.array([BOS_ID]), data, np.array([EOS_ID])])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def held_out_windows(length: int, count: int, root: Optional[Path] = None) -> np.ndarray:
    """`count` windows [count, length] of the held-out stream, evenly spaced (deterministic)."""
    stream = encode_files(split_files(root)[1], root)
    if len(stream) < length:
        raise ValueError(f"the held-out stream ({len(stream)} tokens) is shorter than one window of {length}")
    starts = np.linspace(0, len(stream) - length, count).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts])
