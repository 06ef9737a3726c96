"""Fixtures for the tensor-parallel groundwork tests: the built-in tiny checkpoints (written once per
cache dir by engine/checkpoint/tiny.py) with their configs."""

import pytest

from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup


def _checkpoint(alias: str):
    from engine.checkpoint import tiny

    entry = lookup(alias)
    return tiny.materialize(alias, entry.config_dict()), parse_config(entry.config_dict())


@pytest.fixture(scope="session")
def tiny_ckpt():
    """(path, ModelConfig) of the bf16 `tiny` checkpoint."""
    return _checkpoint("tiny")


@pytest.fixture(scope="session")
def tiny_fp8_ckpt():
    """(path, ModelConfig) of `tiny-fp8` (128 x 128 block-FP8 linears)."""
    return _checkpoint("tiny-fp8")
