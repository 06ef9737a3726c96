"""The default launch configs of the attention kernels fit a Hopper GPU's shared memory at DeepSeek's shapes, and
the decode step's small fused kernels compile for a Hopper GPU at all.

tests/kernels/smem_probe.py compiles them here, on CPU, with Triton's own compiler for sm_90 (H100 / H200:
227 KB of shared memory per block) and reads the compiled kernels' metadata: no GPU needed. A config that
does not fit fails only at its first launch on the GPU ("out of resource: shared memory"), as float32 runs
of V2-Lite did on two H200s before the 4-byte configs existed (docs/perf.md, issue 19).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HOPPER_SMEM = 232448  # bytes one block may use on sm_90
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_attention_configs_fit_hopper_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    run = subprocess.run([sys.executable, "-m", "tests.kernels.smem_probe"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(used) == 8 + 8 + 8 + 2  # attention configs, fused decode-step kernels, block / MoE GEMMs, router top-k,
    # the fused router (logits + gate) at 2 and 4 rows
    over = {case: n for case, n in used.items() if n > HOPPER_SMEM}
    assert not over, f"configs over {HOPPER_SMEM} bytes of shared memory: {over}"
