"""INT4 packing / group quantisation (kernels/int4.py) and the W4AFP8 fused-MoE kernel
(kernels/fused_moe_w4a8.py) against its torch reference, on CPU through the Triton interpreter.

Shapes are small but awkward: two K groups for gate_up, a 64-column down group (a TP slice inside
one 128 group), -1 ids (other EP ranks' experts), an expert that gets no token, the one-launch
decode prologue, several row blocks per expert. (The multi-launch alignment of large batches runs in
tests/gpu/test_w4afp8_gpu.py and benchmarks/bench_w4afp8_moe.py.) Every torch.empty starts as NaN (`poison`).
"""

import pytest
import torch

from kernels.fp8_math import FP8_MAX
from kernels.fused_moe_w4a8 import fused_moe_w4a8, fused_moe_w4a8_ref
from kernels.int4 import dequant_int4, pack_int4, quantize_int4, unpack_int4
from tests.torch_threads import one_thread_fixture

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton-interpreter test on CPU tensors; on a GPU "
                              "run benchmarks/bench_w4afp8_moe.py (checks at DeepSeek-V3 shapes)")


one_thread = one_thread_fixture()  # small tensors: torch on one thread for this module


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_packing_order_is_low_nibble_first():
    """Element 2j in the low nibble, 2j + 1 in the high one, two's complement (SGLang's w4afp8 layout)."""
    q = torch.tensor([[1, -2, 7, -8, 0, 5]])
    want = [(-2 & 0xF) << 4 | 1, (-8 & 0xF) << 4 | 7, 5 << 4 | 0]  # bytes as unsigned
    assert pack_int4(q).view(torch.uint8).tolist() == [want]
    r = torch.randint(-8, 8, (3, 4, 64), generator=_gen(0))
    assert torch.equal(unpack_int4(pack_int4(r)).long(), r)


def test_group_quantisation_matches_a_loop():
    w = torch.randn(6, 256, generator=_gen(1)) * torch.rand(6, 1, generator=_gen(2))
    packed, scale = quantize_int4(w, 128)
    assert packed.shape == (6, 128) and scale.shape == (6, 2) and scale.dtype == torch.float32
    q = unpack_int4(packed).long()
    for r in range(6):
        for g in range(2):
            tile = w[r, g * 128:(g + 1) * 128]
            s = tile.abs().max().item() / 7
            assert scale[r, g].item() == pytest.approx(s, rel=1e-6)
            assert torch.equal(q[r, g * 128:(g + 1) * 128], torch.round(tile / s).clamp(-8, 7).long())
    err = (dequant_int4(packed, scale) - w).abs()
    assert (err <= scale.repeat_interleave(128, dim=1) / 2 + 1e-7).all()
    assert q.min() == -7 or q.max() == 7  # the range is used


def _near_ties(seed, rows=64, group=32):
    """Tiles whose elements sit at or 1-2 float32 ulps from a .5 tie of w / s (s = max|tile| / 7), random signs."""
    g = _gen(seed)
    amax = torch.rand(rows, 1, generator=g) * 3 + 0.1
    s = (amax.double() / 7).float().double()
    k = torch.randint(-7, 7, (rows, group - 1), generator=g).double() + 0.5
    near = (k * s).float()
    step = torch.randint(-2, 3, near.shape, generator=g)
    near = (near + step * torch.finfo(torch.float32).eps * near.abs() / 2).float()
    w = torch.cat([amax, near], 1)
    return w * torch.where(torch.rand(w.shape, generator=g) < 0.5, -1.0, 1.0)


def test_quantisation_is_exact_so_every_device_gives_its_bytes():
    """Against an exact (rational) oracle: s = float32(max|tile| / 7) correctly rounded, q = round-half-even of
    w / s exactly. Both shortcuts a device may take fail these inputs: a float32 reciprocal multiply for the
    scale (CUDA's division by a Python scalar) and a float32 quotient (false .5 ties)."""
    from fractions import Fraction

    w = _near_ties(11)
    packed, scale = quantize_int4(w, 32)
    amax = w.abs().amax(-1)
    want_s = torch.tensor([float(Fraction(a) / 7) for a in amax.tolist()], dtype=torch.float64).float()
    assert torch.equal(scale[:, 0], want_s)
    want_q = torch.tensor([[max(-8, min(7, round(Fraction(x) / Fraction(sc)))) for x in row]
                           for row, sc in zip(w.tolist(), want_s.tolist())])
    assert torch.equal(unpack_int4(packed).long(), want_q)
    reciprocal = amax * torch.tensor(1 / 7, dtype=torch.float32)
    assert (reciprocal != want_s).sum() > 5  # the scale shortcut would be caught
    assert (torch.round(w / scale).clamp(-8, 7).long() != want_q).sum() > 20  # so would the float32 quotient


def _experts(e, n, k, g1, g2, seed):
    g = _gen(seed)
    w13 = torch.randn(e, 2 * n, k, generator=g) * 0.05
    w2 = torch.randn(e, k, n, generator=g) * 0.05
    return (*quantize_int4(w13, g1), *quantize_int4(w2, g2))


# the row-major kernel (weight tiles of 32 rows): float16 mma.sync operands, then e4m3 (v+8)/512 on 64-row tiles
F16_DOT = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=2, BLOCK_SIZE_N_DOWN=64, SWAP_AB_DOWN=0)
FP8_DOT = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=2, BLOCK_SIZE_N_DOWN=32)
# the swapped kernel (64+ weight rows; activations de-interleaved, their per-group sums from the quantiser unless
# ACT_SUMS is 0): one group per K step, then two
SWAPPED = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=2)
SWAPPED_K256 = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, BLOCK_SIZE_N_DOWN=64)


@cpu_only
@pytest.mark.parametrize("t,e,n,k,top_k,g1,g2,drop,cfg", [
    (7, 5, 64, 256, 2, 128, 64, 0.2, F16_DOT),   # one-launch prologue; -1 ids; down group inside one 128 group
    (33, 4, 64, 128, 3, 128, 64, 0.0, F16_DOT),  # ~25 rows per expert: two 16-row blocks each
    (40, 5, 64, 256, 3, 128, 64, 0.2, FP8_DOT),  # the FP8-dot unpack and its offset correction
    (33, 4, 64, 256, 3, 128, 64, 0.2, SWAPPED),  # both GEMMs swapped (the down one on its 64-wide group)
    (9, 5, 128, 512, 2, 128, 32, 0.2, SWAPPED_K256),  # two groups a step; a 32-wide down group: row-major
    (33, 4, 64, 256, 3, 128, 64, 0.2, dict(SWAPPED, ACT_SUMS=0, ACT_SUMS_DOWN=0)),  # A's sums from each tile
], ids=["f16-prologue", "f16-blocks", "fp8-dot", "swapped", "swapped-k256", "swapped-tile-sums"])
def test_kernel_matches_reference(poison, t, e, n, k, top_k, g1, g2, drop, cfg):
    w13, s13, w2, s2 = _experts(e, n, k, g1, g2, seed=t)
    g = _gen(t + 1)
    x = torch.randn(t, k, generator=g)
    ids = torch.rand(t, e, generator=g)[:, : e - 1].topk(top_k, dim=-1).indices.to(torch.int32)  # expert e-1 idle
    if drop:
        ids[torch.rand(t, top_k, generator=g) < drop] = -1
    weights = torch.rand(t, top_k, generator=g) + 0.1
    got = fused_moe_w4a8(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2, config=cfg)
    ref = fused_moe_w4a8_ref(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the reference itself: the INT4 weights' exact product, up to the FP8 activations' rounding (~2^-4)
    exact = fused_moe_w4a8_ref(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2, quantize=False,
                               compute_dtype=torch.float64)
    rel = ((ref.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.1, rel
    assert (ref.abs().max() < FP8_MAX)


@cpu_only
def test_default_config(poison):
    """No config given: the look-up's default for dtype=w4afp8 (BLOCK_SIZE_K 128, one K step per group)."""
    w13, s13, w2, s2 = _experts(4, 64, 256, 128, 64, seed=5)
    x = torch.randn(3, 256, generator=_gen(6))
    ids = torch.tensor([[0, 3], [3, 1], [2, 0]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=_gen(7)) + 0.1
    got = fused_moe_w4a8(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2)
    ref = fused_moe_w4a8_ref(x, w13, w2, ids, weights, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@cpu_only
def test_empty_batch_and_shape_errors():
    w13, s13, w2, s2 = _experts(3, 64, 128, 128, 64, seed=9)
    x = torch.randn(0, 128)
    ids = torch.zeros(0, 2, dtype=torch.int32)
    out = fused_moe_w4a8(x, w13, w2, ids, torch.zeros(0, 2), w13_scale=s13, w2_scale=s2)
    assert out.shape == (0, 128)
    with pytest.raises(ValueError, match="group"):
        fused_moe_w4a8(torch.randn(2, 128), w13, w2, ids[:0].new_zeros(2, 2), torch.ones(2, 2),
                       w13_scale=s13, w2_scale=s2[..., :0])
