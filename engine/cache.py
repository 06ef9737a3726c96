"""Where dsctl keeps the files it generates itself (built-in checkpoints, generated tokenizers).

$DSCTL_CACHE_DIR when set (the user's setting; tests point it at a temporary
directory), else ~/.cache/dsctl.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DSCTL_CACHE_DIR") or Path.home() / ".cache" / "dsctl")
