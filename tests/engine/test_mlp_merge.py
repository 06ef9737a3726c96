"""MLP.merge_gate_up: the stacked gate_up projection computes what separate gate and up projections do
(plain and block-FP8 weights), the builder merges every dense MLP of a loaded model, and FP8 halves
that are not whole scale blocks stay apart."""

from dataclasses import replace

import pytest
import torch

from engine.engine import Engine
from engine.model import fp8_ops
from engine.model.kernel_set import REFERENCE
from engine.model.layers import MLP
from kernels.fp8_math import quantize_block_fp8

BLOCK = (128, 128)


def _fill(mlp: MLP, seed: int, fp8: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        w = 0.05 * torch.randn(lin.out_features, lin.in_features, generator=g)
        if fp8:
            q, s = quantize_block_fp8(w, BLOCK)
            lin.weight.data.copy_(q)
            lin.weight_scale_inv.data.copy_(s)
        else:
            lin.weight.data.copy_(w)


@pytest.mark.parametrize("fp8,gemm", [(False, None), (True, fp8_ops.torch_linear), (True, fp8_ops.triton_linear)],
                         ids=["bf16", "fp8-torch", "fp8-triton"])
def test_merged_forward_equals_separate_projections(fp8, gemm):
    kernels = replace(REFERENCE, gemm=gemm) if gemm else REFERENCE
    mlp = MLP(256, 384, torch.float32, BLOCK if fp8 else None, kernels=kernels)
    _fill(mlp, 0, fp8)
    gate_w, up_w = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    before = mlp(x)
    mlp.merge_gate_up()
    assert mlp.gate_up_proj is not None and not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    assert mlp.gate_up_proj.kernels is kernels  # the merged projection runs the kernels the MLP was given
    assert torch.equal(mlp.gate_up_proj.weight[:384].float(), gate_w.float())
    assert torch.equal(mlp.gate_up_proj.weight[384:].float(), up_w.float())
    if fp8:
        assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert mlp.gate_up_proj.weight_scale_inv.shape == (6, 2)
    after = mlp(x)
    assert before.abs().max() > 1e-3  # random weights: a real output, not zeros
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_fp8_halves_not_whole_blocks_stay_apart():
    mlp = MLP(256, 192, torch.float32, BLOCK)  # 192 rows: one and a half 128-row scale blocks per half
    mlp.merge_gate_up()
    assert mlp.gate_up_proj is None and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")


@pytest.mark.parametrize("model", ["tiny", "tiny-fp8"])
def test_builder_merges_every_dense_mlp(model):
    runner = Engine(model=model, device="cpu").runner
    mlps = [m for m in runner.model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.gate_up_proj is not None for m in mlps)
    names = [n for n, _ in runner.model.named_parameters()]
    assert not [n for n in names if n.endswith((".gate_proj.weight", ".up_proj.weight"))]
