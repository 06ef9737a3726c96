"""GPU-only: the expert-parallel MoE path under CUDA graph capture and torch.compile together (SGLang's
ablation marks EP + CUDA graph + torch.compile as not working; ours must).

One GPU, so each EP rank is built in this process with its group (no collectives): the part EP adds
to a MoE layer (routing with the replicated router, global -> local expert ids with other ranks'
experts as -1, the fused Triton MoE over the rank's whole experts, FP8 kept) is captured in one CUDA
graph per rank, with the function torch.compile'd. Replays on new inputs must equal eager, and the
ranks' outputs must sum to the unsplit layer's (what the all-reduce does on several GPUs).
"""

import functools

import pytest
import torch

from engine.distributed.groups import TPGroup
from engine.model.builder import build_model
from engine.model.moe import TritonMoEBackend, local_expert_ids, select_experts
from tests.distributed.model_tp_targets import _checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _routed(moe, cfg, impl):
    def run(x):
        logits = torch.nn.functional.linear(x.float(), moe.gate_weight.float())
        weights, ids = select_experts(logits, cfg, moe.e_score_correction_bias, moe.kernels.moe_gate)
        if moe.tp.ep_size > 1:
            ids = local_expert_ids(ids, moe.first_expert, moe.num_local_experts)
        return impl.experts(moe, x, weights, ids)
    return run


@pytest.mark.parametrize("alias, block", [("tiny", None), ("tiny-fp8-tp", (128, 128))])
def test_ep_experts_graph_and_compile_match_eager(alias, block):
    path, cfg = _checkpoint(alias)
    impl = TritonMoEBackend()
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(16, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    full = build_model(cfg, 2, torch.bfloat16, "cuda", block, checkpoint=path, mtp=False)[0].layers[1].mlp
    want = [_routed(full, cfg, impl)(x) for x in xs]
    ep = 2
    total = [torch.zeros_like(w, dtype=torch.float32) for w in want]
    for rank in range(ep):
        group = TPGroup(rank=rank, size=ep, ranks=tuple(range(ep)), ep_size=ep)
        moe = build_model(cfg, 2, torch.bfloat16, "cuda", block, group, checkpoint=path, mtp=False)[0].layers[1].mlp
        eager = _routed(moe, cfg, impl)
        compiled = torch.compile(eager, dynamic=False)
        static = xs[0].clone()
        for _ in range(2):  # warm-up: Triton autotune / compilation outside the capture
            compiled(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        for i, x in enumerate(xs):
            static.copy_(x)
            graph.replay()
            ref = eager(x)
            assert ref.abs().max() > 0
            torch.testing.assert_close(out, ref, rtol=0, atol=2e-2 * ref.abs().max().item())
            total[i] += out.float()
    for got, w in zip(total, want):
        torch.testing.assert_close(got, w.float(), rtol=0, atol=3e-2 * w.abs().max().item())


def _placed_routed(moe, impl, x, load, padded):
    """A placed EP rank's part of the MoE layer on x, its routed slots counted into `load`."""
    weights, ids = moe.route(x)
    ids = moe.to_slots(ids)
    load.record(1, ids, padded)
    return impl.experts(moe, x, weights, local_expert_ids(ids, moe.first_expert, moe.num_local_experts))


def test_redundant_experts_and_routing_counts_in_a_compiled_graph():
    """A placement's slot mapping (a hot expert's picks spread over its copies) and the routing counts run inside
    a torch.compile'd CUDA graph: replays on new inputs equal eager, the ranks' outputs sum to the unsplit
    layer's, and the counts of the replays (rows past the real count masked) equal eager counting of the real
    rows."""
    from engine.distributed.expert_placement import plan_placement
    from engine.model.expert_load import ExpertLoad

    path, cfg = _checkpoint("tiny-fp8-tp")
    block, impl, ep, real = (128, 128), TritonMoEBackend(), 2, 11
    placement = plan_placement({1: [50] + [1] * (cfg.n_routed_experts - 1)}, ep, ep)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(16, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    full = build_model(cfg, 2, torch.bfloat16, "cuda", block, checkpoint=path, mtp=False)[0].layers[1].mlp
    want = [_routed(full, cfg, impl)(x) for x in xs]
    total = [torch.zeros_like(w, dtype=torch.float32) for w in want]
    for rank in range(ep):
        group = TPGroup(rank=rank, size=ep, ranks=tuple(range(ep)), ep_size=ep)
        moe = build_model(cfg, 2, torch.bfloat16, "cuda", block, group, checkpoint=path, mtp=False,
                          placement=placement)[0].layers[1].mlp
        graphed, counted = (ExpertLoad({1: moe.slots}, cfg.n_routed_experts, ep, torch.device("cuda"))
                            for _ in range(2))

        run = functools.partial(_placed_routed, moe, impl)
        compiled = torch.compile(functools.partial(run, load=graphed, padded=True), dynamic=False)
        static = xs[0].clone()
        graphed.begin_forward(real)
        for _ in range(2):
            compiled(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static)
        graphed.reset()
        for i, x in enumerate(xs):
            static.copy_(x)
            graphed.begin_forward(real)
            graph.replay()
            ref = run(x, load=counted, padded=False)
            torch.testing.assert_close(out, ref, rtol=0, atol=2e-2 * ref.abs().max().item())
            total[i] += out.float()
        counted.reset()
        for x in xs:
            run(x[:real], load=counted, padded=False)
        assert torch.equal(graphed.counts, counted.counts) and graphed.counts.sum() == 3 * real * cfg.num_experts_per_tok
    for got, w in zip(total, want):
        torch.testing.assert_close(got, w.float(), rtol=0, atol=3e-2 * w.abs().max().item())
