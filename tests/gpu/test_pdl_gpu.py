"""Programmatic dependent launch (--pdl) changes no result: the engine on the GPU, tiny-fp8 in bf16 with CUDA graphs
(every decode-step Triton kernel: norms with quantisation, block-FP8 GEMMs, rope / cache, MLA decode, router,
fused MoE), greedy tokens and log-probs bit-equal with it on and off. PDL moves only when a kernel's programs
start, never what they compute."""

import pytest
import torch

from engine.engine import Engine
from kernels import pdl
from tests.same_outputs import greedy_outputs, logprob_gap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _generate(mode: str):
    eng = Engine(model="tiny-fp8", device="cuda", dtype="bfloat16", pdl=mode, max_total_tokens=4096)
    try:
        assert pdl.enabled() == (mode == "on") and eng.runner.graphs is not None
        return greedy_outputs(eng, (9, 4, 23, 130), seed=7)
    finally:
        eng.close()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs compute capability 9.0+")
def test_pdl_on_and_off_give_the_same_bits():
    assert logprob_gap(_generate("on"), _generate("off")) == 0.0
