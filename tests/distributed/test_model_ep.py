"""Expert parallel (and DP-attention layouts) at the model level, in process (no collectives).

- Each EP rank loads exactly its n_routed_experts / ep whole experts (FP8 weights and block scales
  kept FP8 included) and reads no other expert's tensors at all; everything else is the TP slice.
- Dummy weights at EP, and under DP attention's layout (attention and vocab split over tp / dp
  ranks, MLPs over tp), are exactly the slices of the TP-1 dummy weights.
- The ranks' routed-expert outputs (ids of other ranks' experts mapped to -1) sum to the unsplit
  layer's output, for the torch reference and the Triton kernel (interpreter), bf16 and FP8 kept:
  tiny-fp8, whose 128-wide expert intermediate TP 2 refuses, works at EP 2 and 4.
- A rank's parameter bytes: DeepSeek-V3 at EP 8 holds 32 experts of full width per MoE layer.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine.distributed.groups import TPGroup
from engine.model.builder import build_model, make_modules
from engine.weights.loader import iter_params
from engine.weights.sharding import group_spec, is_scale, weight_name
from kernels.fp8_math import FP8_DTYPE
from tests.distributed.model_tp_targets import _checkpoint, params_by_checkpoint_name
from tests.distributed.test_model_tp import _CountingFile

BLOCK = (128, 128)


def _group(rank: int, size: int, ep: int = 1, dp: int = 1, a2a: str = "none") -> TPGroup:
    """A rank's group (EP and DP-attention layout) without process groups: enough to build and load."""
    per = size // dp
    g = rank // per
    attn = TPGroup(rank=rank % per, size=per, ranks=tuple(range(g * per, (g + 1) * per))) if dp > 1 else None
    return TPGroup(rank=rank, size=size, ranks=tuple(range(size)), ep_size=ep, attn=attn, dp_size=dp, dp_rank=g,
                   moe_a2a=a2a)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _expected(name: str, full: dict, group: TPGroup, block):
    wshape = full[weight_name(name)].shape if is_scale(name) else None
    spec = group_spec(name, full[name].shape, group, block, wshape)
    return full[name] if spec is None else spec.apply(full[name])


class _Reads(_CountingFile):
    """The TP tests' counting handle (whole-tensor reads refused, slice elements counted in
    `_CountingFile.elements`) that also records which expert tensors were touched."""

    experts: set = set()

    def get_slice(self, name):
        m = re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.", name)
        if m:
            _Reads.experts.add((int(m.group(1)), int(m.group(2))))
        return super().get_slice(name)


@pytest.mark.parametrize("alias, block", [("tiny", None), ("tiny-fp8", BLOCK), ("tiny-fp8-tp", BLOCK)])
def test_each_ep_rank_loads_exactly_its_experts(alias, block, monkeypatch):
    from safetensors import safe_open

    import engine.weights.loader as loader

    path, cfg = _checkpoint(alias)
    full = params_by_checkpoint_name(*build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block, checkpoint=path))
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _Reads(safe_open(*a, **k)))
    for ep in (2, 4):
        per = cfg.n_routed_experts // ep
        for rank in range(ep):
            _CountingFile.elements, _Reads.experts = 0, set()
            group = _group(rank, ep, ep=ep)
            model, mtp = build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block, group, checkpoint=path)
            local = params_by_checkpoint_name(model, mtp)
            assert local.keys() == full.keys()
            for name, p in local.items():
                want = _expected(name, full, group, block)
                assert p.dtype == want.dtype and torch.equal(_bytes(p), _bytes(want)), (alias, ep, rank, name)
            assert model.layers[1].mlp.w13.shape[0] == per
            assert {e for _, e in _Reads.experts} == set(range(rank * per, (rank + 1) * per))
            if alias == "tiny":  # bf16 -> float32: every element read is one element of a local parameter
                unique = {id(p): p for p in local.values()}
                assert _CountingFile.elements == sum(p.numel() for p in unique.values())


@pytest.mark.parametrize("alias, block, size, ep, dp, a2a", [
    ("tiny", None, 4, 4, 1, "none"),
    ("tiny-fp8-tp", BLOCK, 2, 2, 1, "torch"),  # all-to-all EP: the shared experts whole on every rank
    ("tiny", None, 4, 1, 2, "none"),  # DP attention: attention TP 2 inside each of 2 groups, MLPs over 4
    ("tiny", None, 2, 2, 2, "none"),  # DP attention + EP: attention whole on each rank, experts split
])
def test_dummy_weights_are_slices_of_tp1_dummy_weights(alias, block, size, ep, dp, a2a):
    _, cfg = _checkpoint(alias)
    full = params_by_checkpoint_name(*build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block, seed=11))
    for rank in range(size):
        group = _group(rank, size, ep=ep, dp=dp, a2a=a2a)
        model, mtp = build_model(cfg, cfg.num_hidden_layers, torch.float32, "cpu", block, group, seed=11)
        shared = model.layers[1].mlp.shared_experts.down_proj.weight
        assert shared.shape[-1] == cfg.moe_intermediate_size * cfg.n_shared_experts // (1 if a2a != "none" else size)
        heads = cfg.num_attention_heads // (size // dp)
        assert model.layers[0].self_attn.num_heads == heads
        for name, p in params_by_checkpoint_name(model, mtp).items():
            want = _expected(name, full, group, block)
            assert p.shape == want.shape and torch.equal(_bytes(p), _bytes(want)), (alias, rank, name)


@pytest.mark.parametrize("alias, block, backend", [
    ("tiny", None, "torch"), ("tiny-fp8", BLOCK, "torch"), ("tiny-fp8", BLOCK, "triton"), ("tiny", None, "triton"),
])
def test_ep_ranks_experts_sum_to_the_unsplit_layer(alias, block, backend):
    from engine.model.moe import TorchMoEBackend, TritonMoEBackend, local_expert_ids, select_experts

    path, cfg = _checkpoint(alias)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    impl = TorchMoEBackend() if backend == "torch" else TritonMoEBackend()

    def experts(model):
        moe = model.layers[1].mlp
        weights, ids = select_experts(torch.nn.functional.linear(x, moe.gate_weight.float()), cfg,
                                      moe.e_score_correction_bias)
        if moe.tp.ep_size > 1:
            ids = local_expert_ids(ids, moe.first_expert, moe.num_local_experts)
        return impl.experts(moe, x, weights, ids)

    want = experts(build_model(cfg, 2, torch.float32, "cpu", block, checkpoint=path, mtp=False)[0])
    assert want.abs().max() > 0
    for ep in (2, 4):
        parts = [experts(build_model(cfg, 2, torch.float32, "cpu", block, _group(r, ep, ep=ep), checkpoint=path,
                                     mtp=False)[0]) for r in range(ep)]
        assert all(p.abs().max() > 0 for p in parts)  # every rank's experts got tokens
        torch.testing.assert_close(sum(parts), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_local_expert_ids():
    from engine.model.moe import local_expert_ids

    ids = torch.tensor([[0, 5, 8], [12, 7, 3]], dtype=torch.int32)
    assert local_expert_ids(ids, 4, 4).tolist() == [[-1, 1, -1], [-1, 3, -1]]
    assert local_expert_ids(ids, 8, 8).tolist() == [[-1, -1, 0], [4, -1, -1]]


def test_deepseek_v3_ep8_rank_holds_32_whole_experts():
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup

    cfg = parse_config(lookup("deepseek-v3").config_dict())

    def nbytes(group):
        with torch.device("meta"):
            mods = make_modules(cfg, 4, torch.bfloat16, BLOCK, group, mtp=False)
        moe = mods[""].layers[3].mlp
        return moe, sum(p.numel() * p.element_size() for _, p in iter_params(mods))

    ep_moe, ep_bytes = nbytes(_group(5, 8, ep=8))
    tp_moe, tp_bytes = nbytes(_group(5, 8))
    assert tuple(ep_moe.w13.shape) == (32, 2 * 2048, 7168) and ep_moe.first_expert == 160
    assert tuple(tp_moe.w13.shape) == (256, 2 * 256, 7168)
    assert ep_moe.gate_weight.shape[0] == 256  # the router stays whole
    assert abs(ep_bytes - tp_bytes) <= 0.001 * tp_bytes  # the same bytes, cut the other way
