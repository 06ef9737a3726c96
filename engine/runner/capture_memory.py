"""A CUDA-graph capture at start-up that runs out of GPU memory, told in the operator's terms.

The KV pool takes --mem-fraction-static of the card; the activations and CUDA graphs live in the rest. When a
capture (or its warm-up forward, or a collective inside it: NCCL reports its own allocations as "unhandled cuda
error ... out of memory") does not fit there, the rank stops with a `GpuMemoryError` that says how much lay
outside the fraction, what was being captured, and the flags that leave more room, instead of a traceback.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from engine.errors import GpuMemoryError
from engine.memory.plan import GB

FRACTION_STEP = 0.02  # the lower --mem-fraction-static the message proposes: this much less


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's allocator out of memory, or a CUDA / NCCL error whose text says so."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def advice(what: str, total_bytes: float, fraction: float, smaller: str) -> str:
    """The message: what ran out, the room it had, and the flags that give more."""
    outside = total_bytes * (1 - fraction)
    lower = round(fraction - FRACTION_STEP, 2)
    return (f"capturing {what} ran out of GPU memory: activations and CUDA graphs have the {outside / GB:.1f} GB "
            f"outside --mem-fraction-static {fraction:g} of this {total_bytes / GB:.0f} GB GPU; give them more "
            f"room with --mem-fraction-static {lower:g} (a smaller KV pool), or capture less: {smaller}")


@contextmanager
def told_out_of_memory(what: str, total_bytes: Optional[float], fraction: float, smaller: str) -> Iterator[None]:
    """Run a capture; an out-of-memory failure in it becomes a GpuMemoryError with `advice` (`total_bytes`: the
    GPU's memory; None, as on CPU: failures pass unchanged)."""
    try:
        yield
    except Exception as exc:
        if total_bytes is None or not is_out_of_memory(exc):
            raise
        raise GpuMemoryError(advice(what, total_bytes, fraction, smaller)) from exc
