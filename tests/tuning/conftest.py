"""Shared helpers for the tuning tests: a tiny FP8 V3-architecture checkpoint dir, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    """config.json only: hidden 128, 4 experts of 128, top-2, 128 x 128 FP8 blocks (tune-* need no weights)."""
    from engine.checkpoint.registry import lookup

    cfg = lookup("tiny-fp8").config_dict()
    cfg.update(hidden_size=128, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
               moe_intermediate_size=128, intermediate_size=256, q_lora_rank=128, kv_lora_rank=128)
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run_dsctl(*args, interpret: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m dsctl ARGS` in a fresh process; TRITON_INTERPRET is set (or cleared) before triton loads."""
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(REPO))
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env.pop("DSCTL_KERNEL_CONFIG_DIR", None)
    return subprocess.run([sys.executable, "-m", "dsctl", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
