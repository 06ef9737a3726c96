"""benchmarks/bench_spec_host.py on a short run: a spec step makes one host-to-device copy of its inputs and
one of its table writes, reads the device twice (the tree's depths, the packed acceptance), and dispatches
about as many torch ops at batch 8 as at batch 1 (no per-node or per-request tensor ops)."""

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_spec_host",
                                                  os.path.join(ROOT, "benchmarks", "bench_spec_host.py"))
    mod = sys.modules["bench_spec_host"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def test_copies_syncs_and_ops_per_step(bench):
    tolist = torch.Tensor.tolist
    one, eight = (bench.measure(b, (3, 4, 8), 32, steps=8, warmup=2) for b in (1, 8))
    assert torch.Tensor.tolist is tolist, "the instrumentation was not undone"
    for row in (one, eight):
        assert row["h2d"] == 2 and row["syncs"] == 2
        assert row["accept"] > 1.5  # the stand-in's drafts are mostly right
    assert eight["ops"] <= one["ops"] + 20
