"""kernels/split_k.py: how many parts a decode-sized GEMM's K loop is split into, and the fused MoE split on a
GPU (the block-FP8 GEMM's are in test_fp8.py; the interpreter tests of both kernels beside their own tests)."""

import pytest
import torch

from kernels.fp8_math import quantize_block_fp8
from kernels.fused_moe import fused_moe
from tests.kernels.split_k_checks import same_bits_every_launch_and_replay


def test_split_k_choice(monkeypatch):
    """A tuned SPLIT_K wins (clamped to the K blocks); no split off the GPU, past the count slots, or where the
    tiles already fill the SMs; otherwise about two programs per SM with at least 4 K blocks per part."""
    import kernels.split_k as sk

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert sk.split_k_for(10, 56, cpu, {"SPLIT_K": 3}) == 3 and sk.split_k_for(10, 2, cpu, {"SPLIT_K": 3}) == 2
    assert sk.split_k_for(10, 56, cpu, {}) == 1
    assert sk.split_k_for(sk.COUNT_SLOTS + 1, 56, cpu, {"SPLIT_K": 3}) == 1
    monkeypatch.setattr(sk, "sm_count", lambda device: 132)
    assert sk.split_k_for(66, 56, gpu, {}) == 4  # q_a + kv_a at TP 1, 32-wide tiles
    assert sk.split_k_for(33, 40, gpu, {}) == 8  # the same at V2's hidden 5120, 64-wide tiles
    assert sk.split_k_for(33, 12, gpu, {}) == 3  # short K: at least 4 blocks a part
    assert sk.split_k_for(288, 56, gpu, {}) == 1  # tiles enough
    assert sk.split_k_for(66, 56, gpu, {"SPLIT_K": 1}) == 1  # a tuned file can turn it off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the split-K reduction across SMs needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 4])
def test_fused_moe_split_k_gpu(t):
    """V2's routed experts at TP 4 (E=160, N=384, K=5120, top-6, FP8): every split of the K loops (and the
    automatic one) within float32 reordering of the unsplit MoE, the same bits on every launch and in a CUDA
    graph's replays, the arrival counts back at 0."""
    g = torch.Generator(device="cuda").manual_seed(t)
    e, n, k, top_k = 160, 384, 5120, 6
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    q13, s13 = quantize_block_fp8(torch.randn(e, 2 * n, k, device="cuda", generator=g) / k ** 0.5)
    q2, s2 = quantize_block_fp8(torch.randn(e, k, n, device="cuda", generator=g) / n ** 0.5)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, top_k, device="cuda", generator=g)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    run = lambda c, out=None: fused_moe(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, config=c, out=out)  # noqa: E731
    whole = run(dict(cfg, SPLIT_K=1))
    for split_cfg in [cfg] + [dict(cfg, SPLIT_K=s) for s in (2, 4, 8)]:
        same_bits_every_launch_and_replay(lambda out=None, c=split_cfg: run(c, out), whole)
