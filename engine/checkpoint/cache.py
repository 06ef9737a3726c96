"""Where dsctl keeps the files it generates itself (built-in checkpoints, generated tokenizers).

$DSCTL_CACHE_DIR when set (the user's setting; tests point it at a temporary
directory), else ~/.cache/dsctl.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("DSCTL_CACHE_DIR") or Path.home() / ".cache" / "dsctl")


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, built by `write(tmp_dir)` the first time and published atomically.

    A `.complete` marker says the directory is whole. Several processes may race: each writes its
    own temporary copy, the first rename wins, and a stale incomplete directory is replaced."""
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
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
