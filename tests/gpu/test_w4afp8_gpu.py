"""GPU-only checks of W4AFP8 (INT4 routed experts, FP8 activations; docs/quantization.md), skipped on CPU.

- the fused kernel against its torch reference at DeepSeek-V3 TP-8 shapes, CUDA-graph replay == eager;
- `--quantization w4afp8` on `tiny-fp8` through the engine: CUDA graphs and torch.compile give eager's greedy
  tokens, NextN speculative decoding gives the same greedy tokens as plain decode, and the teacher-forced
  log-prob error against the FP8 (W8A8) model is printed (bounded loosely: the random tiny model is flat);
- a 4-layer DeepSeek-V3 (3 dense + 1 MoE layer, + MTP) with dummy W4AFP8 weights starts (FP8 linears + INT4
  experts) and generates;
- the online INT4 quantisation gives the host's bytes (kernels/int4.py computes it in float64: device-exact).

Run on one GPU: `python -m pytest tests/gpu/test_w4afp8_gpu.py -q -s` (about 2 minutes on an H100).
"""

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.speculative.helpers import same_up_to_ties

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, top_logprobs=2)
TEACHER = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(3, 40, (n,), generator=g)]


def _engine(**kw):
    kw.setdefault("max_total_tokens", 8192)
    return Engine(model=kw.pop("model", "tiny-fp8"), device="cuda", **kw)


def _v3_problem(t, n=256):
    """Random packed INT4 experts at DeepSeek-V3 shapes (E 256, K 7168, N = n), x and the V3 router's top-8."""
    from kernels.moe_gate import moe_gate  # lazy: Triton on the GPU only

    e, k = 256, 7168
    g = torch.Generator(device="cuda").manual_seed(t)
    w13 = torch.randint(-128, 128, (e, 2 * n, k // 2), device="cuda", generator=g, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (e, k, n // 2), device="cuda", generator=g, dtype=torch.int8)
    s13 = torch.rand(e, 2 * n, k // 128, device="cuda", generator=g) * 2e-3 + 1e-3
    s2 = torch.rand(e, k, n // 128, device="cuda", generator=g) * 2e-3 + 1e-3
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    w, ids = moe_gate(torch.randn(t, e, device="cuda", generator=g), top_k=8, method="noaux_tc", n_group=8,
                      topk_group=4, correction_bias=torch.zeros(e, device="cuda"), routed_scaling_factor=2.5)
    return x, w13, w2, ids, w, s13, s2


# the engine's look-up, then each GEMM kernel explicitly: the swapped one (64+ weight rows per tile) at decode and
# prefill tile heights, the row-major one (SWAP_AB 0) on 16-row tiles
KERNEL_CONFIGS = {
    "engine": None,
    "swapped m16": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4),
    "swapped m64": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=16, num_warps=8,
                        num_stages=3),
    "row-major m16": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                          num_stages=4, SWAP_AB=0),
}


@pytest.mark.parametrize("kernel", list(KERNEL_CONFIGS))
@pytest.mark.parametrize("t", [1, 37, 300])
def test_kernel_matches_reference_at_v3_shapes(t, kernel):
    from kernels.fused_moe_w4a8 import fused_moe_w4a8, fused_moe_w4a8_ref  # lazy: Triton on the GPU only

    cfg = KERNEL_CONFIGS[kernel]
    x, w13, w2, ids, w, s13, s2 = _v3_problem(t)
    got = fused_moe_w4a8(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2, config=cfg)
    ref = fused_moe_w4a8_ref(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2)
    rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert torch.isfinite(got).all() and rel < 1e-2, rel  # bf16 intermediate roundings, accumulation order
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_w4a8(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2, out=out, config=cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_every_unpack_path_matches_reference():
    """The INT4 unpacks (kernels/fused_moe_w4a8.py): float16 operands (mma.sync tiles) and e4m3 (v + 8) / 512 with
    the offset correction (FP8 wgmma tiles, row-major and swapped), each as inline PTX and as Triton ops. PTX and Triton forms compute
    the same numbers, so their outputs are bit-equal; each is within the bf16 roundings of the reference."""
    from kernels.fused_moe_w4a8 import fused_moe_w4a8, fused_moe_w4a8_ref  # lazy: Triton on the GPU only

    x, w13, w2, ids, w, s13, s2 = _v3_problem(300, n=512)
    ref = fused_moe_w4a8_ref(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2).double()
    tiles = {"f16 mma.sync": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, SWAP_AB=0),
             "f16 wgmma": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, FP8_DOT=0, num_warps=4, num_stages=3, SWAP_AB=0),
             "fp8 wgmma": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=8, num_stages=3, SWAP_AB=0),
             "fp8 wgmma swapped (A's sums from the quantiser)": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, num_warps=4,
                                                                     num_stages=4),
             "fp8 wgmma swapped, A's sums from each tile": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, num_warps=4,
                                                               num_stages=4, ACT_SUMS=0, ACT_SUMS_DOWN=0)}
    for name, tile in tiles.items():
        outs = [fused_moe_w4a8(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2,
                               config=dict(tile, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, UNPACK_ASM=asm)) for asm in (1, 0)]
        for got in outs:
            rel = ((got.double() - ref).norm() / ref.norm()).item()
            assert torch.isfinite(got).all() and rel < 1e-2, (name, rel)
        assert torch.equal(outs[0], outs[1]), name


def test_engine_graphs_compile_and_nextn_keep_the_greedy_tokens():
    prompts = _prompts()
    eager = _engine(quantization="w4afp8", disable_cuda_graph=True).generate(input_ids=prompts,
                                                                             sampling_params=GREEDY)
    tokens = [o.token_ids for o in eager]
    assert len({t for ts in tokens for t in ts}) > 4
    for flags in (dict(cuda_graph_bs="1,2,4,8"), dict(cuda_graph_bs="1,2,4,8", enable_torch_compile=True)):
        got = _engine(quantization="w4afp8", **flags).generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in got] == tokens, flags  # same batch rows, same kernels: same roundings
    nextn = _engine(quantization="w4afp8", cuda_graph_bs="1,2,4,8", speculative_algorithm="NEXTN",
                    speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    got = nextn.generate(input_ids=prompts, sampling_params=GREEDY)
    same = same_up_to_ties([o.token_ids for o in got], eager, tie=0.5)  # verify batches other rows than decode
    assert same >= 0.75 * sum(len(t) for t in tokens), same


def test_teacher_forced_logprob_error_vs_fp8():
    ids = _prompts(1, seed=3)[0] + list(range(30, 90))
    lp = {}
    for q in (None, "w4afp8"):
        out = _engine(quantization=q, disable_cuda_graph=True).generate(input_ids=[ids], sampling_params=TEACHER)
        lp[q] = torch.tensor(out[0].prompt_logprobs[1:])
    d = (lp["w4afp8"] - lp[None]).abs()
    print(f"W4AFP8 vs FP8 W8A8 (tiny-fp8, GPU, bf16): mean |dlogp| {d.mean():.4f} max {d.max():.4f} "
          f"over {d.numel()} positions")
    assert 0 < d.mean() < 0.5


def test_dummy_v3_four_layers_starts_and_generates():
    eng = _engine(model="deepseek-v3", load_format="dummy", num_layers=4, quantization="w4afp8",
                  max_total_tokens=4096, cuda_graph_bs="1,2,4")
    moe = eng.runner.model.layers[-1].mlp
    assert moe.w13.dtype == torch.int8 and moe.w13.shape == (256, 4096, 3584) and moe.w2_scale.shape == (256, 7168, 16)
    out = eng.generate(input_ids=_prompts(2), sampling_params=GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_new_tokens for o in out)


def test_online_quantisation_on_the_gpu_gives_the_cpu_bytes():
    from engine.checkpoint import tiny  # lazy: the built-in checkpoint, GPU test only
    from engine.checkpoint.config import parse_config
    from engine.checkpoint.registry import lookup
    from engine.model.builder import build_model

    entry = lookup("tiny-fp8")
    path, cfg = tiny.materialize("tiny-fp8", entry.config_dict()), parse_config(entry.config_dict()).with_int4_experts()
    gpu, _ = build_model(cfg, 2, torch.bfloat16, "cuda", (128, 128), checkpoint=path, mtp=False)
    cpu, _ = build_model(cfg, 2, torch.float32, "cpu", None, checkpoint=path, mtp=False)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        got, want = getattr(gpu.layers[1].mlp, name).cpu(), getattr(cpu.layers[1].mlp, name)
        assert torch.equal(got, want), (name, (got != want).sum().item(), want.numel())


def test_int4_quantisation_gives_the_cpu_bytes_at_near_ties():
    """quantize_int4 on the GPU == on the host, bytes and scales: tiles at or next to .5 ties (where a float32
    quotient or CUDA's reciprocal multiply for `/ 7` would differ) and a DeepSeek-V3-sized random expert."""
    from kernels.int4 import quantize_int4  # lazy: GPU test only
    from tests.kernels.test_w4afp8_kernel import _near_ties  # lazy: its inputs, GPU test only

    g = torch.Generator().manual_seed(0)
    for w, group in ((_near_ties(11), 32), (torch.randn(512, 7168, generator=g) * 0.02, 128)):
        got, want = quantize_int4(w.cuda(), group), quantize_int4(w, group)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b), ((a.cpu() != b).sum().item(), b.numel())
