"""Kernel-test fixtures: `poison` makes every torch.empty start as garbage, so a kernel that skips
writing part of its output fails the comparison instead of passing on leftover zeros."""

import pytest
import torch

from kernels.fp8_math import FP8_DTYPE


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty made during the test starts as NaN (floats, FP8) or -12345 (ints)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == FP8_DTYPE:
            t.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        elif t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-12345)
        return t

    monkeypatch.setattr(torch, "empty", empty)
