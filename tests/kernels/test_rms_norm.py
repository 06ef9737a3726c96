"""RMSNorm kernel (kernels/rms_norm.py) against its torch reference.

CPU: Triton interpreter. Random non-constant rows and weights in bf16 / fp16 / fp32, power-of-two and
odd hidden sizes, one row, no rows, several rows per program, strided (column-slice) inputs, large and
tiny magnitudes, an eps that matters, mixed weight / input dtypes (torch's type promotion), outputs
poisoned before each call."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm_ref, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel sums the squares in another order than torch, so 1 / rms may differ in its last float32 bit.
# In bf16 / fp16 that moves an element only where the normalised value sits on a rounding boundary (then
# by one step, and the product with the weight rounds once more: at most two steps, relative), and such
# elements must be rare. In float32 it moves every element of the row by an ulp or two: no count there.
RTOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 2.0**-20}
ATOL = {torch.bfloat16: 1e-5, torch.float16: 1e-6, torch.float32: 1e-7}
MAX_DIFF_FRAC = {torch.bfloat16: 0.02, torch.float16: 0.02, torch.float32: 1.0}


def _inputs(rows, hidden, dtype, w_dtype=None, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype).to(DEVICE)
    w = (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(w_dtype or dtype).to(DEVICE)
    return x, w


def _check(got, ref, dtype):
    """Within two rounding steps of `dtype` everywhere, and (bf16 / fp16) equal almost everywhere."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=RTOL[dtype], atol=ATOL[dtype])
    if ref.numel():
        frac = (got != ref).float().mean().item()
        assert frac <= MAX_DIFF_FRAC[dtype], f"{frac:.2%} of elements differ from the reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 512), (3, 320), (1, 1000), (2, 576), (33, 64), (4, 2048)])
def test_matches_reference(poison, dtype, rows, hidden):
    x, w = _inputs(rows, hidden, dtype, seed=rows * 7 + hidden)
    _check(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


def test_zero_rows(poison):
    x, w = _inputs(0, 512, torch.bfloat16)
    got = rms_norm_triton(x, w, 1e-6)
    assert got.shape == (0, 512) and got.dtype == torch.bfloat16


def test_leading_dims_and_1d():
    x, w = _inputs(6, 320, torch.bfloat16, seed=3)
    x3 = x.view(2, 3, 320)
    _check(rms_norm_triton(x3, w, 1e-6), rms_norm_ref(x3, w, 1e-6), torch.bfloat16)
    _check(rms_norm_triton(x[2], w, 1e-6), rms_norm_ref(x[2], w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("shape", [(4, 576), (2, 3, 576)])
def test_strided_column_slice(poison, shape):
    """latent[:, :512] (DeepSeek's kv_a_layernorm input) is read in place and matches its contiguous copy."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1.0 + 0.5 * torch.randn(512, generator=g)).to(torch.bfloat16).to(DEVICE)
    x = wide[..., :512]
    assert not x.is_contiguous()
    got = rms_norm_triton(x, w, 1e-6)
    assert torch.equal(got, rms_norm_triton(x.contiguous(), w, 1e-6))
    _check(got, rms_norm_ref(x, w, 1e-6), torch.bfloat16)
    # the slice past the normalised columns must not leak in: change them, same result
    wide[..., 512:] = 1e4
    assert torch.equal(rms_norm_triton(x, w, 1e-6), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1e4, 1e-3])
def test_magnitudes(poison, dtype, scale):
    if dtype == torch.float16 and scale == 1e4:
        scale = 1e3  # fp16 tops out at 65504
    x, w = _inputs(4, 1000, dtype, scale=scale, seed=5)
    got = rms_norm_triton(x, w, 1e-6)
    _check(got, rms_norm_ref(x, w, 1e-6), dtype)
    assert got.float().abs().max() > 0.5  # normalised: O(1) whatever the input's scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eps_matters(poison, dtype):
    """Rows with mean(x^2) ~ 1e-6: eps = 1e-6 roughly halves 1 / rms, eps = 1e-2 dwarfs it."""
    x, w = _inputs(3, 320, dtype, scale=1e-3, seed=9)
    for eps in (1e-6, 1e-2):
        _check(rms_norm_triton(x, w, eps), rms_norm_ref(x, w, eps), dtype)
    a, b = rms_norm_triton(x, w, 1e-6), rms_norm_triton(x, w, 1e-2)
    assert (a.float().abs().mean() / b.float().abs().mean()) > 10


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_mixed_dtypes_promote_like_torch(poison, x_dtype, w_dtype):
    x, w = _inputs(3, 320, x_dtype, w_dtype=w_dtype, seed=13)
    ref = rms_norm_ref(x, w, 1e-6)
    got = rms_norm_triton(x, w, 1e-6)
    assert got.dtype == ref.dtype == torch.promote_types(x_dtype, w_dtype)
    # the normalised row is rounded to x's dtype before the weight, so its tolerance is x's
    torch.testing.assert_close(got, ref, rtol=RTOL[x_dtype], atol=ATOL[x_dtype])
    assert (got != ref).float().mean().item() <= MAX_DIFF_FRAC[x_dtype]


def test_out_argument(poison):
    x, w = _inputs(5, 512, torch.bfloat16, seed=17)
    out = torch.full((5, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_triton(x, w, 1e-6, out=out) is out
    _check(out, rms_norm_ref(x, w, 1e-6), torch.bfloat16)
    with pytest.raises(ValueError):
        rms_norm_triton(x, w, 1e-6, out=torch.empty(5, 512, dtype=torch.float32, device=DEVICE))


def test_unsupported_inputs_raise():
    x, w = _inputs(2, 64, torch.bfloat16)
    with pytest.raises(ValueError):
        rms_norm_triton(x, w[:32], 1e-6)
    with pytest.raises(ValueError):
        rms_norm_triton(x.double(), w, 1e-6)


def test_engine_rms_norm_kernels():
    """engine/model/norm_ops.py: 'triton' is the kernel (bit for bit) where it takes the inputs, the torch
    reference where it does not; 'torch' is the reference."""
    from engine.model.norm_ops import torch_rms_norm, triton_rms_norm

    x, w = _inputs(3, 320, torch.bfloat16, seed=21)
    assert torch.equal(triton_rms_norm(x, w, 1e-6), rms_norm_triton(x, w, 1e-6))
    assert torch.equal(torch_rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    xd = x.double()  # float64: not a dtype the kernel takes
    assert torch.equal(triton_rms_norm(xd, w, 1e-6), rms_norm_ref(xd, w, 1e-6))
