"""Whether Triton runs its CPU interpreter (TRITON_INTERPRET): the one test every module uses.

The kernels pass it to their launches (exact roundings the interpreter lacks), the engine's
start-up checks and the block-FP8 linear use it to allow Triton kernels on CPU tensors, and
`dsctl tune-*` uses it to tune on CPU in tests. Triton itself decides whether it interprets,
so this asks Triton (its own parsing of the variable) rather than reading the variable again.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton launches kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs  # lazy: imports triton (~0.5 s); callers on CPU paths import this module
    except ImportError:  # Triton before 3.4 (no knobs) read the variable as exactly "1"
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)
