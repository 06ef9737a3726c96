"""Operator-facing errors of `dsctl tune-*` (one line, no traceback: DsctlError subclasses)."""

from engine.errors import DsctlError


class NoGpuError(DsctlError):
    """Tuning times kernels on the GPU it tunes for; there is none here."""


class TuneFailed(DsctlError):
    """Some shapes could not be tuned (the others' files were still written)."""

    exit_code = 1
