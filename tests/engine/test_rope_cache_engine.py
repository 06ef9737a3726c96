"""The engine with MLA's latent norm, rope and cache write in one Triton kernel (--rope-cache-backend triton,
kernels/mla_rope_cache.py) against the torch form op by op, where the other tests do not cover it:

- CPU (the interpreter): --disable-mla, where the kernel only normalises and rotates (no latent cache);
- GPU (marked gpu): bf16 with CUDA graphs, a bf16 and an FP8 (e4m3) latent cache: every value the kernel makes is
  bit-equal to the torch form's (tests/kernels/test_mla_rope_cache.py), so tokens and log-probs are equal.

The float32 latent cache on CPU is tests/engine/test_triton_backends.py's case."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from kernels.interpret import interpreting
from tests.same_outputs import greedy_outputs, logprob_gap


def _generate(backend: str, **flags):
    eng = Engine(model="tiny", rope_cache_backend=backend, max_total_tokens=4096, **flags)
    try:
        assert (eng.runner.kernels.rope_cache is not None) == (backend == "triton")
        return greedy_outputs(eng, (11, 5, 30), seed=3)
    finally:
        eng.close()


@pytest.mark.skipif(not interpreting(), reason="the CPU case runs the kernel in Triton's interpreter")
def test_disable_mla_tokens_equal_the_torch_form():
    flags = dict(device="cpu", dtype="float32", disable_mla=True)
    assert logprob_gap(_generate("triton", **flags), _generate("torch", **flags)) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="an FP8 KV cache and CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_tokens_equal_the_torch_form(kv_cache_dtype):
    flags = dict(device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    assert logprob_gap(_generate("triton", **flags), _generate("torch", **flags)) == 0.0
