"""Search space: grid sizes, pruning by block shape / shared memory / registers / batch size, neighbours."""

from tuning import search_space as ss


def _cfg(bm, bn, bk, gm=1, w=4, s=3):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=s)


def test_full_grid_is_sglangs():
    assert ss.FULL.size() == len(ss.FULL.configs()) == 5 * 4 * 3 * 4 * 2 * 4
    assert ss.COARSE.size() < ss.FULL.size() / 5


def test_smem_formula_and_limit():
    up, down = ss.moe_kinds(256, 7168, "fp8_w8a8", (128, 128))
    cfg = _cfg(64, 128, 128, s=4)
    assert ss.smem_bytes(cfg, up) == 4 * (64 * 128 + 2 * 128 * 128)  # gate and up tiles
    assert ss.smem_bytes(cfg, down) == 4 * (64 * 128 + 128 * 128)
    assert ss.static_reason(cfg, up, ss.Limits()) is None
    assert ss.static_reason(cfg, up, ss.Limits(smem_bytes=100_000)) == "shared memory"
    bf16_up, _ = ss.moe_kinds(256, 7168, "bf16", None)
    assert ss.smem_bytes(cfg, bf16_up) == 2 * ss.smem_bytes(cfg, up)


def test_prune_by_smem_limit_drops_only_what_does_not_fit():
    kinds = ss.moe_kinds(256, 7168, "fp8_w8a8", (128, 128))
    big, small = ss.Limits(), ss.Limits(smem_bytes=64 * 1024)
    kept_big = ss.prune(ss.FULL.configs(), lambda c: ss.moe_static_reason(c, kinds, big))
    kept_small = ss.prune(ss.FULL.configs(), lambda c: ss.moe_static_reason(c, kinds, small))
    assert 0 < len(kept_small.kept) < len(kept_big.kept) < ss.FULL.size()
    assert kept_small.dropped["shared memory"] > kept_big.dropped["shared memory"] > 0
    for c in kept_small.kept:
        assert ss.smem_bytes(ss.up_part(c), kinds[0]) <= small.smem_bytes
    # every config dropped for shared memory really exceeds the limit in one of the two GEMMs
    dropped = [c for c in ss.FULL.configs() if ss.moe_static_reason(c, kinds, small) == "shared memory"]
    assert all(max(ss.smem_bytes(c, kinds[0]), ss.smem_bytes(c, kinds[1])) > small.smem_bytes for c in dropped)


def test_block_shape_and_register_rules():
    kind = ss.GemmKind(n=1536, k=7168, block_shape=(128, 128))
    lim = ss.Limits()
    assert ss.static_reason(_cfg(64, 128, 256), kind, lim) == "block shape"  # K tile straddles two scale groups
    assert ss.static_reason(_cfg(64, 128, 64), kind, lim) is None
    assert ss.static_reason(_cfg(256, 256, 128, w=4, s=2), kind, lim) == "registers"  # 512 accumulators a thread
    assert ss.static_reason(_cfg(16, 256, 128), ss.GemmKind(n=64, k=128), lim) == "tile > matrix"


def test_batch_pruning():
    # decode: 1 token x top-8 over 256 experts -> BLOCK_SIZE_M 16 only
    assert ss.moe_rows_cap(1, 8, 256) == 16
    assert ss.moe_rows_cap(4096, 8, 256) == 512
    assert ss.batch_reason_moe(_cfg(32, 64, 128), 1, 8, 256) == "BLOCK_SIZE_M > rows"
    assert ss.batch_reason_gemm(_cfg(64, 64, 128), 8) == "BLOCK_SIZE_M > rows"
    assert ss.batch_reason_gemm(_cfg(16, 64, 128, gm=16), 16) == "GROUP_SIZE_M >= row tiles"
    assert ss.batch_reason_gemm(_cfg(16, 64, 128, gm=16), 4096) is None
    small = ss.moe_candidates(1, 256, 7168, 8, 256, "fp8_w8a8", (128, 128), ss.Limits())
    large = ss.moe_candidates(4096, 256, 7168, 8, 256, "fp8_w8a8", (128, 128), ss.Limits())
    assert {c["BLOCK_SIZE_M"] for c in small.kept} == {16}
    assert len(small.kept) < len(large.kept) <= ss.COARSE.size()
    assert len(large.kept) <= 120  # the staged search's first stage stays small at every batch size


def test_neighbours_and_down_overrides():
    base = _cfg(64, 128, 128, gm=1, w=4, s=3)
    near = ss.neighbours(base)
    assert len(near) == 3 + 3 + 1 and all(sum(base[k] != n[k] for k in base) == 1 for n in near)
    v = ss.with_down(base, {"BLOCK_SIZE_N": 64})
    assert v["BLOCK_SIZE_N_DOWN"] == 64 and ss.up_part(v) == base
    assert ss.down_part(v)["BLOCK_SIZE_N"] == 64
    assert ss.with_down(v, {"BLOCK_SIZE_N": 128}) == base  # back to the up value: no override stored
    assert "down N64" in ss.describe(v)
