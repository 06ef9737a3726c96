"""MLA decode kernel (kernels/mla_decode.py) against its pure-torch reference.

CPU: Triton interpreter (tests/kernels/conftest.py), small shapes. Inputs are
random, slots are scattered through the pool, sequence lengths are odd and not
multiples of the tile sizes, outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.mla_decode import DecodeConfig, mla_decode, mla_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(seq_lens, heads, lkv, rope, q_per_req=1, max_ctx=None, seed=0):
    """Random queries, cache (float32 master copy) and a scattered req->token table."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    max_ctx = max_ctx or max([1, *seq_lens]) + 3
    max_reqs = num_reqs + 2
    num_slots = max_ctx * max_reqs + 5
    table = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=g).to(torch.int32)
    for r in range(max_reqs):
        table[r] = perm[r * max_ctx:(r + 1) * max_ctx]
    rows = torch.randperm(max_reqs, generator=g)[:num_reqs]
    cache = torch.randn(num_slots, 1, lkv + rope, generator=g)
    q = torch.randn(num_reqs * q_per_req, heads, lkv, generator=g)
    q_pe = torch.randn(num_reqs * q_per_req, heads, rope, generator=g)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return dict(q=to(q), q_pe=to(q_pe), cache=to(cache), table=to(table), rows=to(rows),
                seq_lens=to(torch.tensor(seq_lens, dtype=torch.int64)))


def _run(c, kv_cache, sm_scale, q_dtype=torch.bfloat16, **kw):
    q, q_pe = c["q"].to(q_dtype), c["q_pe"].to(q_dtype)
    out = torch.full(q.shape, float("nan"), dtype=q_dtype, device=q.device)
    got = mla_decode(q, q_pe, kv_cache, c["table"], c["rows"], c["seq_lens"], sm_scale, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), "some output elements were not written"
    return got


def _ref(c, kv_cache, sm_scale, q_dtype=torch.bfloat16, q_per_req=1, kv_scale=1.0):
    return mla_decode_ref(c["q"].to(q_dtype), c["q_pe"].to(q_dtype), kv_cache, c["table"], c["rows"],
                          c["seq_lens"], sm_scale, q_per_req=q_per_req, kv_scale=kv_scale,
                          compute_dtype=torch.float64)


@pytest.mark.parametrize("heads,lkv,rope,splits", [
    (4, 64, 16, None),
    (8, 64, 16, 1),
    (16, 64, 32, 3),
    (20, 32, 16, 5),  # heads not a multiple of the head block
])
def test_bf16_matches_reference(heads, lkv, rope, splits):
    c = _case([37, 1, 90, 17, 64], heads, lkv, rope, seed=heads)
    kv = c["cache"].bfloat16()
    got = _run(c, kv, 0.13, num_kv_splits=splits)
    ref = _ref(c, kv, 0.13)
    assert _rel(got, ref) < 1.5e-2
    assert (got.double() - ref.double()).abs().max().item() < 0.1


def test_deepseek_head_dims_and_config_variants():
    c = _case([45, 130], 16, 512, 64, seed=3)
    kv = c["cache"].bfloat16()
    ref = _ref(c, kv, 0.07)
    for cfg in (DecodeConfig(block_h=16, block_n=32), DecodeConfig(block_h=32, block_n=16, kv_load="split")):
        got = _run(c, kv, 0.07, num_kv_splits=3, config=cfg)
        assert _rel(got, ref) < 1.5e-2
    # The shipped defaults (split count chosen from batch size and SM count).
    assert _rel(_run(c, kv, 0.07), ref) < 1.5e-2
    kv8 = (c["cache"] * 16).to(FP8)
    assert _rel(_run(c, kv8, 0.07, kv_scale=1 / 16), _ref(c, kv8, 0.07, kv_scale=1 / 16)) < 1.5e-2


def test_float32_query_and_2d_cache_and_many_splits():
    c = _case([70, 3, 33], 4, 64, 16, seed=5)
    kv = c["cache"].bfloat16().squeeze(1)  # [num_slots, Lkv + R] is accepted too
    got = _run(c, kv, 0.2, q_dtype=torch.float32, num_kv_splits=9, config=DecodeConfig(block_n=16))
    assert got.dtype == torch.float32
    assert _rel(got, _ref(c, kv, 0.2, q_dtype=torch.float32)) < 1.5e-2


def test_splits_do_not_change_the_result():
    c = _case([100, 57, 21], 8, 64, 16, seed=7)
    kv = c["cache"].bfloat16()
    one = _run(c, kv, 0.1, q_dtype=torch.float32, num_kv_splits=1)
    many = _run(c, kv, 0.1, q_dtype=torch.float32, num_kv_splits=6, config=DecodeConfig(block_n=16))
    assert _rel(many, one) < 5e-3


@pytest.mark.parametrize("scale_as_tensor,fp16_math,fp8", [(False, True, FP8), (True, True, FP8), (False, False, FP8),
                                                          (False, True, torch.float8_e5m2)])
def test_fp8_cache_within_quantisation_error(scale_as_tensor, fp16_math, fp8):
    c = _case([51, 9, 77], 8, 64, 32, seed=11)
    master = c["cache"] * 3.0  # values well inside the format's range after scaling
    scale = master.abs().max().item() / torch.finfo(fp8).max
    kv8 = (master / scale).to(fp8)
    kv_scale = torch.tensor(scale, device=master.device) if scale_as_tensor else scale
    got = _run(c, kv8, 0.05, num_kv_splits=2, kv_scale=kv_scale,
               config=DecodeConfig(kv_load="split", fp16_math=fp16_math))
    # 1) Same function as the reference on the dequantised cache, at bf16 accuracy.
    ref_q = _ref(c, kv8, 0.05, kv_scale=scale)
    assert _rel(got, ref_q) < 1.5e-2
    # 2) Against float64 attention over the unquantised cache: within the error that
    #    quantising the cache alone causes (measured, not guessed), plus bf16 rounding.
    ref_master = _ref(c, master.double(), 0.05)
    quant_err = _rel(ref_q, ref_master)
    assert 0 < quant_err < (0.2 if fp8 == FP8 else 0.4)  # e5m2 keeps 2 mantissa bits, e4m3 3
    assert _rel(got, ref_master) < quant_err + 1.5e-2


def test_fp8_upcast_is_exact_for_every_e4m3_value():
    # Every finite e4m3fn byte pattern (subnormals, both zeros, +-448) as cache
    # values; a query that attends to one slot only returns that slot's c_kv.
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    values = values[~torch.isnan(values.float())]  # 254 finite patterns
    lkv, rope = 64, 16
    rows = -(-values.numel() // lkv)
    kv = torch.zeros(rows * lkv, dtype=FP8)
    kv[:values.numel()] = values
    kv = torch.cat((kv.view(rows, lkv).view(torch.uint8), torch.zeros(rows, rope, dtype=torch.uint8)), 1).view(FP8)
    q = torch.zeros(1, 16, lkv, device=DEVICE)
    q_pe = torch.zeros(1, 16, rope, device=DEVICE)
    for slot in range(rows):
        table = torch.tensor([[slot]], dtype=torch.int32, device=DEVICE)
        for fp16_math in (False, True):
            out = mla_decode(q, q_pe, kv.to(DEVICE), table, torch.tensor([0], device=DEVICE),
                             torch.tensor([1], device=DEVICE), 0.1, kv_scale=0.5,
                             config=DecodeConfig(kv_load="split", block_n=16, fp16_math=fp16_math))
            expect = kv[slot, :lkv].float().to(DEVICE) * 0.5
            assert torch.equal(out[0, 3], expect), (slot, fp16_math)


def test_fp16_math_keeps_huge_queries_finite():
    # FP8 caches use fp16 dots: queries beyond fp16's range are clamped, not inf/NaN.
    c = _case([30, 7], 4, 64, 16, seed=23)
    c["q"][0, 1, 5] = 1e6
    kv8 = (c["cache"] * 10).to(FP8)
    got = _run(c, kv8, 1e-3, q_dtype=torch.float32, kv_scale=0.1,
               config=DecodeConfig(kv_load="split", fp16_math=True))
    clamped = dict(c, q=c["q"].clamp(-65504, 65504))
    assert _rel(got, _ref(clamped, kv8, 1e-3, q_dtype=torch.float32, kv_scale=0.1)) < 1.5e-2


def test_fp8_direct_single_split_path():
    c = _case([200], 16, 64, 16, seed=13)
    scale = 0.01
    kv8 = (c["cache"] / scale).to(FP8)
    got = _run(c, kv8, 0.1, num_kv_splits=1, kv_scale=scale, config=DecodeConfig(block_n=64))
    assert _rel(got, _ref(c, kv8, 0.1, kv_scale=scale)) < 1.5e-2


@pytest.mark.parametrize("q_per_req,splits", [(2, None), (3, 4)])
def test_several_queries_per_request_are_causal(q_per_req, splits):
    # Request 3 (seq_len 1) has fewer visible positions than draft tokens: its first
    # rows see nothing and must be zeros.
    c = _case([40, 19, 66, 1], 8, 64, 16, q_per_req=q_per_req, seed=17 + q_per_req)
    kv = c["cache"].bfloat16()
    got = _run(c, kv, 0.1, num_kv_splits=splits, q_per_req=q_per_req, config=DecodeConfig(block_n=16))
    ref = _ref(c, kv, 0.1, q_per_req=q_per_req)
    assert _rel(got, ref) < 1.5e-2
    last = 3 * q_per_req
    assert torch.all(got[last:last + q_per_req - 1] == 0)
    # The causal limit matters: the last draft row differs from the first.
    assert _rel(got[q_per_req - 1], got[0]) > 1e-2


def test_zero_length_sequence_gives_zeros():
    c = _case([0, 25], 4, 64, 16, seed=19)
    kv = c["cache"].bfloat16()
    got = _run(c, kv, 0.1, num_kv_splits=2)
    assert torch.all(got[0] == 0)
    assert _rel(got[1], _ref(c, kv, 0.1)[1]) < 1.5e-2


def test_empty_batch():
    c = _case([5], 4, 64, 16)
    q = torch.empty(0, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    q_pe = torch.empty(0, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out = mla_decode(q, q_pe, c["cache"].bfloat16(), c["table"], empty, empty, 0.1)
    assert out.shape == (0, 4, 64)


def test_rejects_mismatched_rows():
    c = _case([5, 6], 4, 64, 16)
    with pytest.raises(ValueError):
        mla_decode(c["q"].bfloat16(), c["q_pe"].bfloat16(), c["cache"].bfloat16(), c["table"], c["rows"],
                   c["seq_lens"], 0.1, q_per_req=2)


# ------------------------------------------------------------------ kv_load="fp8dot"
# q.k as FP8 dots: the kernel quantises each query row to e4m3 (scale = amax / 448, the
# latent and rope parts separately). Two references: `mla_decode_ref` on the same FP8
# cache (what the caller gets, error = the queries' e4m3 rounding) and the same reference
# fed those quantised queries (the kernel's exact math, error = bf16/fp16 rounding only).


def _quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 quantisation as the kernel does it, returned dequantised (float32)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def _fp8_cache(c, mult=3.0, fp8=FP8):
    master = c["cache"] * mult
    scale = master.abs().max().item() / torch.finfo(fp8).max
    return master, (master / scale).to(fp8), scale


def _fp8dot_errors(c, kv8, scale, sm_scale, q_dtype=torch.bfloat16, q_per_req=1, **kw):
    """(fp8dot output, its error vs mla_decode_ref, vs the quantised-query reference, "split" error)."""
    kv_scale = kw.pop("kv_scale", scale)
    cfg = kw.pop("config", DecodeConfig(block_n=16))
    got = _run(c, kv8, sm_scale, q_dtype=q_dtype, q_per_req=q_per_req, kv_scale=kv_scale,
               config=replace(cfg, kv_load="fp8dot"), **kw)
    split = _run(c, kv8, sm_scale, q_dtype=q_dtype, q_per_req=q_per_req, kv_scale=kv_scale,
                 config=replace(cfg, kv_load="split"), **kw)
    ref = _ref(c, kv8, sm_scale, q_dtype=q_dtype, q_per_req=q_per_req, kv_scale=scale)
    quantised = dict(c, q=_quant_rows(c["q"].to(q_dtype)), q_pe=_quant_rows(c["q_pe"].to(q_dtype)))
    ref_q8 = _ref(quantised, kv8, sm_scale, q_dtype=torch.float32, q_per_req=q_per_req, kv_scale=scale)
    return got, _rel(got, ref), _rel(got, ref_q8), _rel(split, ref)


@pytest.mark.parametrize("lkv,rope,splits,block_h,block_n,fp16_math", [
    (64, 16, 3, 16, 16, True),
    (128, 64, None, 64, 32, True),  # 64-row head block (FP8 wgmma on sm_90), 48 rows padding
    (64, 32, 1, 16, 16, False),  # one split: stage 1 writes the output directly; bf16 p.V
])
def test_fp8dot_matches_reference(lkv, rope, splits, block_h, block_n, fp16_math):
    # Lengths 1..130: several tiles, splits crossed, a one-token request.
    c = _case([51, 9, 130, 77, 1], 16, lkv, rope, seed=31 + lkv + rope)
    master, kv8, scale = _fp8_cache(c)
    cfg = DecodeConfig(block_h=block_h, block_n=block_n, fp16_math=fp16_math)
    got, err, err_q8, err_split = _fp8dot_errors(c, kv8, scale, 0.06, num_kv_splits=splits, config=cfg)
    print(f"fp8dot lkv={lkv} rope={rope}: rel err {err:.2e} (quantised-query ref {err_q8:.2e}), split {err_split:.2e}")
    # The kernel computes exactly "queries rounded to e4m3, then attention": against that
    # reference only the bf16/fp16 roundings remain (measured 2.7e-3 .. 4.1e-3, as "split").
    assert err_q8 < 1.5e-2
    # Against the reference with unquantised queries: the queries' e4m3 rounding (measured
    # 1.6e-2 .. 3.0e-2 over 6 seeds of these cases, 1.8e-2 .. 2.7e-2 on an H100, where "split"
    # is within 3.5e-4 .. 1.1e-3 of the same reference).
    assert err < 6e-2
    # ... and less than the cache's own e4m3 quantisation costs (measured 0.5x .. 0.8x of it).
    assert err < 1.25 * _rel(_ref(c, kv8, 0.06, kv_scale=scale), _ref(c, master.double(), 0.06))
    # The checks can fail: attention over the wrong cache rows is far outside the tolerance.
    wrong = dict(c, table=c["table"][:, torch.randperm(c["table"].shape[1], generator=torch.Generator().manual_seed(1))])
    wrong_out = _run(wrong, kv8, 0.06, num_kv_splits=splits, kv_scale=scale, config=replace(cfg, kv_load="fp8dot"))
    wrong_err = _rel(wrong_out, _ref(c, kv8, 0.06, kv_scale=scale))
    print(f"  wrong cache rows: rel err {wrong_err:.2e}")
    assert wrong_err > 0.3


def test_fp8dot_speculative_rows_and_scale_tensor():
    # Two draft rows per request (block_h 32: both in one program), kv_scale as a device
    # tensor, a request shorter than the draft count (its first row sees nothing: zeros).
    c = _case([40, 19, 66, 1], 16, 64, 32, q_per_req=2, seed=41)
    _, kv8, scale = _fp8_cache(c)
    got, err, err_q8, err_split = _fp8dot_errors(
        c, kv8, scale, 0.06, q_per_req=2, num_kv_splits=3, kv_scale=torch.tensor(scale, device=DEVICE),
        config=DecodeConfig(block_h=32, block_n=16))
    print(f"fp8dot q_per_req=2: rel err {err:.2e} (quantised-query ref {err_q8:.2e}), split {err_split:.2e}")
    assert err_q8 < 1.5e-2
    assert err < 6e-2
    assert torch.all(got[6] == 0)
    assert _rel(got[1], got[0]) > 1e-2  # the causal limit matters


def test_fp8dot_extreme_query_rows():
    # Queries are quantised with a per-row scale: an all-zero row (attends uniformly) and
    # a row with one huge value (fp32 queries, far beyond fp16/e4m3 range) stay finite and right.
    c = _case([30, 57], 16, 64, 16, seed=43)
    c["q"][0, 1] = 0
    c["q_pe"][0, 1] = 0
    c["q"][1, 2, 5] = 1e6
    _, kv8, scale = _fp8_cache(c)
    got, err, err_q8, _ = _fp8dot_errors(c, kv8, scale, 0.06, q_dtype=torch.float32, num_kv_splits=2)
    assert torch.isfinite(got).all()
    assert err_q8 < 1.5e-2
    assert err < 6e-2


def test_fp8dot_falls_back_where_it_cannot_run():
    # e5m2 caches run "split", 16-bit caches "tile": the same results bit for bit.
    c = _case([37, 90], 16, 64, 16, seed=47)
    _, kv5, scale = _fp8_cache(c, fp8=torch.float8_e5m2)
    for kv, mode, kw in ((kv5, "split", dict(kv_scale=scale)), (c["cache"].bfloat16(), "tile", {})):
        got = _run(c, kv, 0.06, num_kv_splits=2, config=DecodeConfig(block_n=16, kv_load="fp8dot"), **kw)
        same = _run(c, kv, 0.06, num_kv_splits=2, config=DecodeConfig(block_n=16, kv_load=mode), **kw)
        assert torch.equal(got, same), mode
    with pytest.raises(ValueError):
        _run(c, c["cache"].bfloat16(), 0.06, config=DecodeConfig(kv_load="fp8"))
