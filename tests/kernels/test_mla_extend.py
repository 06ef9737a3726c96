"""Extend/prefill attention kernel (kernels/mla_extend.py) against its pure-torch reference.

CPU: Triton interpreter (tests/kernels/conftest.py), small shapes, random inputs,
odd lengths that are not multiples of the tile sizes, NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla_extend import ExtendConfig, extend_attention, extend_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(extend_lens, prefix_lens, heads, dqk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, p = sum(extend_lens), sum(prefix_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    return dict(q=rnd(t, heads, dqk), k=rnd(t, heads, dqk), v=rnd(t, heads, dv),
                kp=rnd(p, heads, dqk), vp=rnd(p, heads, dv),
                el=torch.tensor(extend_lens, device=DEVICE), pl=torch.tensor(prefix_lens, device=DEVICE))


def _run(c, sm_scale, **kw):
    out = torch.full((c["q"].shape[0], c["q"].shape[1], c["v"].shape[-1]), float("nan"),
                     dtype=c["q"].dtype, device=DEVICE)
    got = extend_attention(c["q"], c["k"], c["v"], c["kp"], c["vp"], c["el"], c["pl"], sm_scale, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), "some output elements were not written"
    return got


def _ref(c, sm_scale):
    return extend_attention_ref(c["q"], c["k"], c["v"], c["kp"], c["vp"], c["el"], c["pl"], sm_scale,
                                compute_dtype=torch.float64)


# float32 dots run as tf32 on GPU tensor cores (Triton's default), exact in the interpreter.
F32_TOL = 1e-5 if DEVICE == "cpu" else 3e-3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.5e-2), (torch.float16, 3e-3), (torch.float32, F32_TOL)])
def test_matches_reference_with_prefix(dtype, tol):
    # Dqk = 24 (16 + 8: not a power of two, like DeepSeek's 192 = 128 + 64), Dv = 16.
    c = _case([5, 0, 33, 1, 17], [7, 4, 0, 19, 40], 3, 24, 16, dtype, seed=1)
    got = _run(c, 0.3)
    assert _rel(got, _ref(c, 0.3)) < tol


def test_deepseek_head_dims():
    c = _case([19, 6], [10, 0], 2, 192, 128, torch.bfloat16, seed=2)
    got = _run(c, 192 ** -0.5, max_extend_len=19)
    assert _rel(got, _ref(c, 192 ** -0.5)) < 1.5e-2


@pytest.mark.parametrize("cfg", [ExtendConfig(block_m=16, block_n=32), ExtendConfig(block_m=32, block_n=16),
                                 ExtendConfig(block_m=32, block_n=16, mask_diag_only=False)])
def test_block_shapes_and_power_of_two_head_dim(cfg):
    c = _case([40, 3], [21, 50], 2, 32, 32, torch.float32, seed=3)
    got = _run(c, 0.2, config=cfg)
    assert _rel(got, _ref(c, 0.2)) < F32_TOL


def test_causal_mask_and_prefix_matter():
    c = _case([20], [15], 2, 24, 16, torch.float32, seed=4)
    got = _run(c, 0.5)
    no_prefix = dict(c, kp=c["kp"][:0], vp=c["vp"][:0], pl=torch.zeros_like(c["pl"]))
    assert _rel(got, _run(no_prefix, 0.5)) > 1e-2
    # First new token: attends to the prefix and itself only.
    first = extend_attention_ref(c["q"][:1], c["k"][:1], c["v"][:1], c["kp"], c["vp"],
                                 torch.tensor([1]), c["pl"].cpu(), 0.5, compute_dtype=torch.float64)
    assert _rel(got[:1], first) < F32_TOL


def test_no_prefix_at_all():
    c = _case([9, 26], [0, 0], 4, 24, 16, torch.bfloat16, seed=5)
    got = _run(c, 0.25)
    assert _rel(got, _ref(c, 0.25)) < 1.5e-2


def test_empty_batch():
    c = _case([], [], 2, 24, 16, torch.bfloat16)
    out = extend_attention(c["q"], c["k"], c["v"], c["kp"], c["vp"], c["el"], c["pl"], 0.1)
    assert out.shape == (0, 2, 16)
