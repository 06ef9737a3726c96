"""Paged MHA decode over per-head K/V (kernels/mha_decode.py, the --disable-mla decode) against its reference.

CPU: Triton interpreter, small shapes. Random inputs, slots scattered through the pool, odd lengths that are
not multiples of the tile, a zero-length (padded) row, an empty batch, outputs poisoned before each call."""

from __future__ import annotations

import pytest
import torch

from kernels.mha_decode import mha_decode, mha_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(seq_lens, heads, dqk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, max_ctx = len(seq_lens), max([1, *seq_lens]) + 3
    max_reqs = n + 2
    num_slots = max_ctx * max_reqs + 5
    perm = torch.randperm(num_slots, generator=g).to(torch.int32)
    table = perm[:max_reqs * max_ctx].view(max_reqs, max_ctx).clone()
    rows = torch.randperm(max_reqs, generator=g)[:n]
    cache = torch.randn(num_slots, heads * (dqk + dv), generator=g)
    q = torch.randn(n, heads, dqk, generator=g)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return dict(q=to(q), cache=to(cache), table=to(table), rows=to(rows),
                seq_lens=to(torch.tensor(seq_lens, dtype=torch.int64)), dv=dv)


def _run(c, cache, scale, q_dtype=torch.bfloat16, **kw):
    q = c["q"].to(q_dtype)
    out = torch.full((q.shape[0], q.shape[1], c["dv"]), float("nan"), dtype=q_dtype, device=q.device)
    got = mha_decode(q, cache, c["table"], c["rows"], c["seq_lens"], c["dv"], scale, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), "some output elements were not written"
    return got


def _ref(c, cache, scale, q_dtype=torch.bfloat16, kv_scale=1.0):
    return mha_decode_ref(c["q"].to(q_dtype).double(), cache.double() if cache.dtype != FP8 else cache,
                          c["table"], c["rows"], c["seq_lens"], c["dv"], scale, kv_scale=kv_scale)


@pytest.mark.parametrize("heads,dqk,dv,block_n", [
    (4, 24, 16, None),  # the oracle checkpoints' heads: 16 + 8 (Dqk not a power of two)
    (3, 32, 16, 16),  # power-of-two Dqk (no second part), odd head count
    (2, 192, 128, 32),  # DeepSeek-V3's per-head dims
    (5, 40, 24, 16),  # Dv not a power of two
])
def test_matches_reference(heads, dqk, dv, block_n):
    c = _case([37, 1, 70, 17, 16], heads, dqk, dv, seed=heads + dqk)
    cache = c["cache"].bfloat16()
    got = _run(c, cache, 0.13, block_n=block_n)
    ref = _ref(c, cache, 0.13)
    assert _rel(got, ref) < 1.5e-2
    assert (got.double() - ref.double()).abs().max().item() < 0.1


def test_float32_padded_row_and_empty_batch():
    c = _case([29, 0, 5], 4, 24, 16, seed=1)
    got = _run(c, c["cache"], 0.2, q_dtype=torch.float32)
    ref = _ref(c, c["cache"], 0.2, q_dtype=torch.float32)
    assert _rel(got, ref.to(torch.float32)) < 1e-4
    assert (got[1] == 0).all()  # a padded (zero-length) row gives zeros, not NaN
    empty = _case([], 4, 24, 16)
    assert mha_decode(empty["q"], empty["cache"], empty["table"], empty["rows"], empty["seq_lens"], 16, 0.2
                      ).shape == (0, 4, 16)


def test_fp8_cache_with_scale():
    c = _case([51, 9, 77], 4, 24, 16, seed=11)
    master = c["cache"] * 3.0
    scale = master.abs().max().item() / torch.finfo(FP8).max
    kv8 = (master / scale).to(FP8)
    got = _run(c, kv8, 0.05, kv_scale=scale)
    ref = mha_decode_ref(c["q"].bfloat16(), kv8, c["table"], c["rows"], c["seq_lens"], 16, 0.05, kv_scale=scale)
    assert _rel(got, ref) < 1.5e-2
    assert 0 < _rel(ref, _ref(c, master, 0.05)) < 0.2  # the quantisation error is real and bounded


def test_rejects_a_cache_of_the_wrong_width():
    c = _case([3], 4, 24, 16)
    with pytest.raises(ValueError, match="heads 4"):
        mha_decode(c["q"], c["cache"][:, :-1], c["table"], c["rows"], c["seq_lens"], 16, 0.1)
