"""The custom all-reduce on 2 (and 4) GPUs of one node (skipped with fewer).

- benchmarks/bench_all_reduce.py --check-only under torchrun: one-shot, two-shot and the engine's op against
  NCCL, bf16 messages of 1 KiB .. 16 MiB, eager and in CUDA graphs (replays with new inputs, eager calls
  between them), every rank's output bit-identical and within bf16 rounding of NCCL's;
- the engine at TP 2 with --all-reduce-backend custom gives the greedy tokens of one GPU, eager and with
  CUDA graphs (DeepSeek-V2-Lite, 4 layers, dummy float32 weights, as tests/gpu/test_multi_gpu.py).
The kernels themselves on one GPU (simulated peers) are tests/test_custom_all_reduce.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")]

TIE_GAP, LOGPROB_ATOL = 0.02, 0.02  # tests/gpu/test_multi_gpu.py's bounds


@pytest.mark.parametrize("gpus", [2, 4])
def test_bench_checks_pass(gpus):
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
           os.path.join(ROOT, "benchmarks", "bench_all_reduce.py"), "--check-only", "--max-mib", "16",
           "--custom-max-mib", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all checks passed" in out.stdout


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_engine_tp2_custom_matches_one_gpu(mode):
    from benchmarks import multi_gpu_check as check
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    vocab = parse_config(lookup("deepseek-v2-lite").config_dict()).vocab_size
    flags = dict(model="deepseek-v2-lite", load_format="dummy", device="cuda", dtype="float32", max_model_len=512,
                 num_layers=4)
    ids = check.prompts(vocab, 8)
    ref = check.run_layout(flags, "tp1", "eager", ids, 16)
    run = check.run_layout({**flags, "all_reduce_backend": "custom"}, "tp2", mode, ids, 16)
    assert not ref.failed and not run.failed, (ref.failed, run.failed)
    c = check.compare(ref, run)
    assert c.max_dlogprob < LOGPROB_ATOL, c
    assert check.verdict(run, c, TIE_GAP), c
