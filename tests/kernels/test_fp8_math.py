"""kernels/fp8_math.py, the one home of the block-FP8 maths, against a plain loop over the tiles.

Weight tiles (bn x bk) and activation groups (1 x group) on random inputs of ragged sizes
(partial edge tiles), with leading dims and empty tensors: quantisation must be bit-identical
to the loop, dequantisation exact, and the round trip within e4m3's rounding error.
"""

import pytest
import torch

from kernels import fp8_math as fm

U = 2.0 ** -4  # e4m3 unit roundoff (relative)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))  # rows of very different sizes


def _loop_quant(x2d, block, eps):
    """One tile at a time: s = max|tile| / 448 (>= eps / 448), q = clamp(tile / s) in e4m3."""
    n, k = x2d.shape
    bn, bk = block
    q = torch.empty(n, k, dtype=fm.FP8_DTYPE)
    s = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            tile = x2d[i:i + bn, j:j + bk].float()
            scale = tile.abs().max().clamp(min=eps) / 448.0
            s[i // bn, j // bk] = scale
            q[i:i + bn, j:j + bk] = (tile / scale).clamp(-448.0, 448.0).to(fm.FP8_DTYPE)
    return q, s


def _loop_dequant(q, s, block):
    out = torch.empty(q.shape)
    bn, bk = block
    for i in range(0, q.shape[0], bn):
        for j in range(0, q.shape[1], bk):
            out[i:i + bn, j:j + bk] = q[i:i + bn, j:j + bk].float() * s[i // bn, j // bk]
    return out


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("n,k,block", [(300, 200, (128, 128)), (128, 128, (128, 128)), (7, 300, (128, 128)),
                                       (130, 129, (64, 32)), (1, 1, (128, 128))])
def test_weight_blocks_match_the_loop_and_round_trip(n, k, block):
    w = _rand(n, k, seed=n * k)
    q, s = fm.quantize_block_fp8(w, block)
    q_ref, s_ref = _loop_quant(w, block, fm.WEIGHT_EPS)
    assert s.shape == fm.block_scale_shape(w.shape, block) == s_ref.shape and s.dtype == torch.float32
    assert torch.equal(s, s_ref) and _same_bits(q, q_ref)
    deq = fm.dequant_block_fp8(q, s, block)
    assert torch.equal(deq, _loop_dequant(q, s, block))
    assert fm.dequant_block_fp8(q, s, block, torch.float64).dtype == torch.float64
    assert torch.equal(fm.expand_block_scale(s, n, k, block) * q.float(), deq)
    # round trip: e4m3 rounding of each element (normals relative u, subnormals half a step of 2**-9 * s)
    step = fm.expand_block_scale(s, n, k, block).double() * 2.0 ** -10
    err = (deq.double() - w.double()).abs()
    assert (err <= U * w.double().abs() + step * 1.001).all()
    if n * k > 1:
        assert err.max() > 0  # e4m3 is not exact on random data (a lone element is: it maps to 448 exactly)


def test_weight_blocks_with_leading_dims_are_per_matrix():
    w = _rand(3, 70, 150, seed=1)  # stacked experts
    q, s = fm.quantize_block_fp8(w)
    assert s.shape == (3, 1, 2) == fm.block_scale_shape(w.shape, fm.WEIGHT_BLOCK)
    for e in range(3):
        q_e, s_e = _loop_quant(w[e], fm.WEIGHT_BLOCK, fm.WEIGHT_EPS)
        assert _same_bits(q[e], q_e) and torch.equal(s[e], s_e)
    assert torch.equal(fm.dequant_block_fp8(q, s, fm.WEIGHT_BLOCK)[2], _loop_dequant(q[2], s[2], fm.WEIGHT_BLOCK))


@pytest.mark.parametrize("shape,group", [((5, 300), 128), ((2, 3, 200), 64), ((257,), 128), ((4, 17), 128)])
def test_activation_groups_match_the_loop(shape, group):
    x = _rand(*shape, seed=len(shape) + group)
    q, s = fm.quantize_groups(x, group)
    k = shape[-1]
    q_ref, s_ref = _loop_quant(x.reshape(-1, k), (1, group), fm.ACT_EPS)
    assert q.shape == x.shape and s.shape == (*shape[:-1], -(-k // group))
    assert _same_bits(q.reshape(-1, k), q_ref) and torch.equal(s.reshape(-1, s.shape[-1]), s_ref)
    deq = fm.dequant_groups(q, s, group)
    assert torch.equal(deq.reshape(-1, k), _loop_dequant(q_ref, s_ref, (1, group)))


def test_zero_tiles_get_the_eps_scale_and_zero_values():
    x = torch.zeros(2, 256)
    x[1, 200] = 3.0
    q, s = fm.quantize_groups(x)
    assert torch.equal(s[0], torch.full((2,), fm.ACT_EPS / 448.0)) and s[1, 0] == fm.ACT_EPS / 448.0
    assert s[1, 1] == 3.0 / 448.0 and q.float()[1, 200] == 448.0 and q.float().abs().sum() == 448.0
    w = torch.zeros(129, 128)
    _, sw = fm.quantize_block_fp8(w)
    assert torch.equal(sw, torch.full((2, 1), fm.WEIGHT_EPS / 448.0))


def test_empty_inputs():
    q, s = fm.quantize_groups(torch.randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = fm.quantize_groups(torch.randn(3, 0))
    assert q.shape == (3, 0) and s.shape == (3, 0)
    assert fm.dequant_groups(q, s).shape == (3, 0)


def test_scale_shapes():
    assert fm.block_scale_shape((7168, 2048), (128, 128)) == (56, 16)
    assert fm.block_scale_shape((256, 4096, 7168), (128, 128)) == (256, 32, 56)
    assert fm.block_scale_shape((129, 1), (128, 128)) == (2, 1)
    assert fm.block_scale_shape((5, 300), (1, 128)) == (5, 3)
    assert fm.cdiv(0, 128) == 0 and fm.cdiv(129, 128) == 2


def test_dequant_of_a_slice_starting_inside_a_tile():
    w = _rand(300, 260, seed=7)
    q, s = fm.quantize_block_fp8(w, (128, 128))
    full = fm.dequant_block_fp8(q, s, (128, 128))
    # rows 192..299 (starts 64 rows into tile 1), columns 130..199 (2 into tile 1): its tiles are s[1:, 1:]
    part = fm.dequant_block_fp8(q[192:, 130:200], s[1:, 1:], (128, 128), offset=(64, 2))
    assert torch.equal(part, full[192:, 130:200])
