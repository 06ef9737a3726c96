"""Check and time the MoE / FP8 kernels at DeepSeek-V3 shapes on one CUDA GPU.

    python benchmarks/bench_moe_fp8.py [--out DIR] [--sections ceil,check,moe,gemm,small] [--quick] [--tp 8]

1. ceilings: device-to-device copy bandwidth (bytes read + written), bf16 cuBLAS and
   fp8 torch._scaled_mm rates on 8192^3.
2. checks: every kernel against its torch reference at V3 shapes (odd sizes too), FP8
   against float64 within its quantisation error; CUDA-graph replay == eager.
3. fused MoE (E=256, hidden 7168, N = 2048 / --tp: 256 at TP 8, 2048 at TP 1, top-8), FP8 block and
   bf16, batch 1..512: a small config sweep; floor = bytes of the expert weights the routing touches
   (+ scales) / measured copy bandwidth.
4. block-FP8 GEMM on V3's linear shapes at --tp (TP 8: the six of the first run; other TPs: every
   block-FP8 linear, from tuning/shapes.py), M 1..8192, vs torch bf16 matmul (cuBLAS).
With --quick only the built-in default config and the tuned file's config (where one is shipped for
this GPU) are timed.
5. small kernels: router (moe_gate), moe_align, fp8_bmm (absorbed MLA), quantisation.

Times are medians (triton.testing.do_bench, which flushes L2 before each run) of a CUDA
graph that runs the op over R rotating input sets (different routings / weights), divided
by R: the engine replays graphs for decode, and rotation keeps weights out of L2.
Writes DIR/log.txt, DIR/results.md (tables) and DIR/results.json (rows + best configs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import tuned_configs as tc  # noqa: E402
from kernels.fp8 import (  # noqa: E402
    _CUBLAS_STATE,
    block_fp8_matmul,
    block_fp8_matmul_q,
    block_fp8_matmul_ref,
    cublas_block_fp8_supported,
    fp8_bmm,
    fp8_bmm_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from kernels.fp8_math import FP8_DTYPE, expand_block_scale  # noqa: E402
from kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from kernels.moe_align import moe_align_block_size, moe_align_block_size_ref  # noqa: E402
from kernels.moe_gate import moe_gate, moe_gate_ref  # noqa: E402

E, HIDDEN, N_SHARD, TOP_K = 256, 7168, 256, 8
MOE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
MOE_DTYPES = ("fp8_w8a8", "bf16")
GEMM_SHAPES = {  # name: (N, K) at TP 8
    "q_a 7168->1536": (1536, 7168),
    "q_b 1536->3072": (128 * 192 // 8, 1536),
    "kv_a 7168->576": (576, 7168),
    "o_proj 2048->7168": (7168, 128 * 128 // 8),
    "mlp gate_up 7168->4608": (18432 * 2 // 8, 7168),
    "mlp down 2304->7168": (7168, 18432 // 8),
}
GEMM_MS = [1, 16, 64, 256, 1024, 2048, 4096, 8192]
MLA_HEADS = (16, 128)  # TP 8 and DP attention
MOE_ROTATIONS = 8
CHECK_TOKENS = (1, 37, 256)
SMALL_BATCHES = (1, 64, 512, 4096)
DEV = "cuda"


def cfg(bm, bn, bk, gm=1, w=4, s=3, **extra):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=s,
                **extra)


MOE_FP8_CANDIDATES = [
    cfg(16, 32, 128, s=4, BLOCK_SIZE_N_DOWN=64),
    cfg(16, 32, 128, s=4, BLOCK_SIZE_N_DOWN=64, QUANT_A_DOWN=1),
    cfg(16, 32, 128, s=6, BLOCK_SIZE_N_DOWN=64, QUANT_A_DOWN=1),
    cfg(16, 32, 128, s=8, BLOCK_SIZE_N_DOWN=64, QUANT_A_DOWN=1),
    cfg(16, 16, 128, s=8, BLOCK_SIZE_N_DOWN=64, QUANT_A_DOWN=1),
    cfg(16, 64, 128, s=4),
    cfg(16, 64, 128, s=4, QUANT_A_DOWN=1),
    cfg(16, 64, 128, s=6, BLOCK_SIZE_N_DOWN=128, QUANT_A_DOWN=1),
    cfg(16, 128, 128, s=3, QUANT_A=1),
    cfg(16, 128, 128, s=4, QUANT_A_DOWN=1),
    cfg(32, 64, 128, s=4),
    cfg(32, 128, 128, s=3),
    cfg(32, 128, 128, s=4, QUANT_A_DOWN=1),
    cfg(64, 128, 128, gm=16, s=3),
]
MOE_BF16_CANDIDATES = [
    cfg(16, 32, 64, s=4, BLOCK_SIZE_N_DOWN=64),
    cfg(16, 64, 64, s=4),
    cfg(16, 64, 128, s=3),
    cfg(32, 64, 64, s=4),
    cfg(64, 128, 64, gm=16, s=3),
]
# configs the checks run (separate quant; quant in the down GEMM; whole quant in GEMM; BLOCK_SIZE_M 64)
MOE_FP8_CHECK = (MOE_FP8_CANDIDATES[0], MOE_FP8_CANDIDATES[3], MOE_FP8_CANDIDATES[8], MOE_FP8_CANDIDATES[-1])
MOE_BF16_CHECK = (MOE_BF16_CANDIDATES[0], MOE_BF16_CANDIDATES[-1])
CUBLAS = cfg(128, 128, 128, CUBLAS=1)  # cuBLASLt block-scaled FP8 (torch._scaled_mm), when available
GEMM_SMALL_CANDIDATES = [
    cfg(16, 32, 128, s=5), cfg(16, 64, 128, s=4), cfg(16, 64, 128, s=4, QUANT_A=1), cfg(32, 64, 128, s=4),
    cfg(16, 128, 128, s=4), CUBLAS,
]
GEMM_LARGE_CANDIDATES = [
    cfg(64, 128, 128, gm=8, s=3), cfg(64, 128, 128, gm=8, s=4), cfg(128, 128, 128, gm=8, w=8, s=3),
    cfg(128, 128, 128, gm=8, w=8, s=4), cfg(128, 64, 128, gm=8, w=4, s=4), CUBLAS,
]
BMM_CANDIDATES = [(16, 64), (16, 128), (32, 128), (16, 256), (32, 256), (64, 128)]  # (block_m, block_n)

BEST_KEY = "best"
LOG = None
FAILURES: list[str] = []


def log(*args):
    msg = " ".join(str(a) for a in args)
    print(msg, flush=True)
    if LOG:
        LOG.write(msg + "\n")
        LOG.flush()


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def check(name, value, limit, lower=None):
    ok = value < limit and (lower is None or value > lower) and not math.isnan(value)
    log(f"  [{'ok' if ok else 'FAIL'}] {name}: {value:.3g} (limit {limit:g})")
    if not ok:
        FAILURES.append(name)
    return ok


def cfg_str(c):
    keys = {"BLOCK_SIZE_M": "M", "BLOCK_SIZE_N": "N", "BLOCK_SIZE_K": "K", "GROUP_SIZE_M": "g", "num_warps": "w",
            "num_stages": "s"}
    parts = [f"{keys.get(k, k)}{v}" for k, v in c.items() if not k.endswith("_DOWN")]
    parts += [f"{keys.get(k[:-5], k[:-5])}{v}(down)" for k, v in c.items() if k.endswith("_DOWN")]
    return " ".join(parts)


def sweep(make_fns, configs, label):
    """[(us, config)] for each config that runs; every time is logged."""
    results = []
    for c in configs:
        try:
            us = graph_ms(make_fns(c)) * 1e3
            results.append((us, c))
            log(f"    {label} {us:9.1f}us  {cfg_str(c)}")
        except Exception as exc:  # noqa: BLE001
            log(f"    {label} config {c} failed: {type(exc).__name__}: {str(exc)[:300]}")
    return results


def graph_ms(fns):
    """Median time of one call: a CUDA graph runs fns one after another; per-call = replay / len(fns)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = do_bench(g.replay, warmup=10, rep=40, return_mode="median")
    del g
    return ms / len(fns)


# --------------------------------------------------------------------------- ceilings


def ceilings():
    log("\n## ceilings")
    src = torch.randn(256 * 1024 * 1024, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * 4 / ms / 1e6  # GB/s
    src = dst = None  # free the memory (the lambdas above still name them)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    bf16_tf = 2 * 8192 ** 3 / ms / 1e9
    fp8_tf = float("nan")
    try:
        a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
        one = torch.tensor(1.0, device=DEV)
        ms = do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                      warmup=25, rep=200, return_mode="median")
        fp8_tf = 2 * 8192 ** 3 / ms / 1e9
    except Exception as exc:  # noqa: BLE001
        log("  fp8 _scaled_mm unavailable:", exc)
    log(f"  copy bandwidth {bw:.0f} GB/s; bf16 matmul {bf16_tf:.0f} TFLOP/s; fp8 _scaled_mm {fp8_tf:.0f} TFLOP/s")
    return dict(copy_gbps=bw, bf16_tflops=bf16_tf, fp8_tflops=fp8_tf)


# --------------------------------------------------------------------------- data


def _rand_fp8(shape, g):
    """Random e4m3 values (never zeros-only; within the finite range)."""
    return (torch.randn(*shape, device=DEV, generator=g, dtype=torch.bfloat16) * 64).clamp(-448, 448).to(FP8_DTYPE)


def moe_weights(fp8: bool, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    if fp8:
        w13 = _rand_fp8((E, 2 * N_SHARD, HIDDEN), g)
        w2 = _rand_fp8((E, HIDDEN, N_SHARD), g)
        s13 = torch.rand(E, -(-2 * N_SHARD // 128), -(-HIDDEN // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
        s2 = torch.rand(E, -(-HIDDEN // 128), -(-N_SHARD // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
        return w13, w2, s13, s2
    w13 = torch.randn(E, 2 * N_SHARD, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) * 0.01
    w2 = torch.randn(E, HIDDEN, N_SHARD, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    return w13, w2, None, None


def routing(t, seed):
    """Router output of the V3 gate (noaux_tc) on random logits: realistic, spread top-8."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(t, E, device=DEV, generator=g)
    bias = torch.randn(E, device=DEV, generator=g) * 0.1
    w, ids = moe_gate(logits, top_k=TOP_K, method="noaux_tc", n_group=8, topk_group=4, correction_bias=bias,
                      routed_scaling_factor=2.5)
    return ids, w


def expert_bytes(fp8: bool):
    per = 3 * N_SHARD * HIDDEN * (1 if fp8 else 2)
    if fp8:
        kb, nb = -(-HIDDEN // 128), -(-N_SHARD // 128)
        per += (2 * nb * kb + kb * nb) * 4
    return per


def block_weights(n, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = _rand_fp8((n, k), g)
    s = torch.rand(-(-n // 128), -(-k // 128), device=DEV, generator=g) * 1e-4 + 0.5e-4
    return w, s


# --------------------------------------------------------------------------- checks


def checks():
    log("\n## checks (GPU kernels vs torch references)")
    log(f"  cuBLASLt block-scaled FP8 via torch._scaled_mm: {cublas_block_fp8_supported(DEV)} {_CUBLAS_STATE}")
    torch.manual_seed(0)
    # quantisation
    x = torch.randn(333, HIDDEN, device=DEV, dtype=torch.bfloat16)
    x = x * torch.rand(333, 1, device=DEV, dtype=torch.bfloat16)
    q, s = per_token_group_quant_fp8(x)
    qr, sr = per_token_group_quant_fp8_ref(x)
    check("quant scales rel err", rel(s, sr), 1e-6)
    check("quant fp8 values differing from ref (fraction)", (q.float() != qr.float()).float().mean().item(), 1e-3)
    # block GEMM
    for name, (n, k) in GEMM_SHAPES.items():
        w, ws = block_weights(n, k, seed=n + k)
        w_deq = w.float() * expand_block_scale(ws, n, k, (128, 128))
        for m in (1, 333):
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = block_fp8_matmul_ref(a, w, ws, out_dtype=torch.float32)
            exact = a.double() @ w_deq.double().T
            variants = [("default", None), ("quant-in-gemm", cfg(64, 128, 128, s=3, QUANT_A=1))]
            if cublas_block_fp8_supported(DEV, k=k):
                variants.append(("cublas", CUBLAS))
            for tag, c in variants:
                out = block_fp8_matmul(a, w, ws, config=c)
                check(f"block gemm {name} M={m} {tag} vs ref", rel(out, ref), 5e-3)
                check(f"block gemm {name} M={m} {tag} vs float64 (quantisation error)", rel(out, exact), 0.06)
    # fused MoE
    w13, w2, s13, s2 = moe_weights(True, seed=1)
    for t in CHECK_TOKENS:
        ids, wts = routing(t, seed=t)
        x = torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16)
        mirror = fused_moe_ref(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2).float()
        exact = fused_moe_ref(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, compute_dtype=torch.float64,
                              quantize=False)
        for c in (None, *MOE_FP8_CHECK):
            out = fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, config=c)
            tag = "default" if c is None else json.dumps(c, separators=(",", ":"))
            check(f"fused_moe fp8 T={t} {tag} vs ref", rel(out, mirror), 1e-2)
            check(f"fused_moe fp8 T={t} {tag} vs float64 (quantisation error)", rel(out, exact), 0.08)
    ids, wts = routing(64, seed=5)
    x = torch.randn(64, HIDDEN, device=DEV, dtype=torch.bfloat16)
    eager = fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2)
    g = torch.cuda.CUDAGraph()
    fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2)
    with torch.cuda.graph(g):
        static = fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2)
    g.replay()
    torch.cuda.synchronize()
    check("fused_moe fp8 graph replay vs eager (max abs diff, must be 0)",
          (static.float() - eager.float()).abs().max().item(), 1e-30)
    del w13, w2, s13, s2
    w13, w2, _, _ = moe_weights(False, seed=2)
    for t in CHECK_TOKENS:
        ids, wts = routing(t, seed=t + 1)
        x = torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16)
        ref = fused_moe_ref(x, w13, w2, ids, wts).float()
        for c in (None, *MOE_BF16_CHECK):
            out = fused_moe(x, w13, w2, ids, wts, config=c)
            check(f"fused_moe bf16 T={t} {'default' if c is None else c['BLOCK_SIZE_M']} vs ref", rel(out, ref), 1e-2)
    del w13, w2
    # router
    for t in (1, 333):
        g = torch.Generator(device=DEV).manual_seed(t)
        logits, bias = torch.randn(t, E, device=DEV, generator=g), torch.randn(E, device=DEV, generator=g) * 0.1
        kw = dict(top_k=8, method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5)
        w, i = moe_gate(logits, correction_bias=bias, **kw)
        wr, ir = moe_gate_ref(logits, correction_bias=bias, **kw)
        check(f"moe_gate noaux_tc T={t} ids differing (fraction)", (i != ir).float().mean().item(), 1e-9)
        check(f"moe_gate noaux_tc T={t} weights", (w - wr).abs().max().item(), 1e-5)
        kw = dict(top_k=6, method="group_limited_greedy", n_group=8, topk_group=3, norm_topk_prob=False,
                  routed_scaling_factor=16.0)
        v2 = logits[:, :160].contiguous()
        w, i = moe_gate(v2, **kw)
        wr, ir = moe_gate_ref(v2, **kw)
        check(f"moe_gate group_limited_greedy E=160 T={t} ids differing", (i != ir).float().mean().item(), 1e-9)
    # align
    for t, bm in ((SMALL_BATCHES[2], 16), (SMALL_BATCHES[3], 64), (3, 16)):
        ids, _ = routing(t, seed=t + 9)
        a, r = moe_align_block_size(ids, bm, E), moe_align_block_size_ref(ids, bm, E)
        npp = int(r.num_post_pad)
        same = int(a.num_post_pad) == npp and torch.equal(a.sorted_ids[:npp], r.sorted_ids[:npp]) \
            and torch.equal(a.expert_ids, r.expert_ids)
        check(f"moe_align T={t} bm={bm} differs from ref", 0.0 if same else 1.0, 0.5)
    # fp8 bmm (absorbed MLA): W_UK [H, 128, 512], W_UV [H, 512, 128] with checkpoint block scales
    for h in MLA_HEADS:
        kvb, kvb_s = block_weights(h * 256, 512, seed=h)
        view = kvb.view(h, 256, 512)
        sview = kvb_s.view(h, 2, 4)
        w_uk, s_uk = view[:, :128, :], sview[:, :1, :]  # [H, K=128, N=512], scales [H, 1, 4]
        w_uv, s_uv = view[:, 128:, :].transpose(1, 2), sview[:, 1:, :].transpose(1, 2)  # [H, 512, 128], [H, 4, 1]
        for m in (1, 37):
            q_nope = torch.randn(m, h, 192, device=DEV, dtype=torch.bfloat16)[:, :, :128].transpose(0, 1)
            out = fp8_bmm(q_nope, w_uk, s_uk)
            check(f"fp8_bmm W_UK H={h} M={m} vs ref", rel(out, fp8_bmm_ref(q_nope, w_uk, s_uk)), 5e-3)
            deq = w_uk.float() * expand_block_scale(s_uk, 128, 512, (128, 128))
            check(f"fp8_bmm W_UK H={h} M={m} vs float64", rel(out, torch.bmm(q_nope.double(), deq.double())), 0.06)
            lat = torch.randn(h, m, 512, device=DEV, dtype=torch.bfloat16)
            out = fp8_bmm(lat, w_uv, s_uv)
            check(f"fp8_bmm W_UV H={h} M={m} vs ref", rel(out, fp8_bmm_ref(lat, w_uv, s_uv)), 5e-3)


# --------------------------------------------------------------------------- fused MoE timing


def moe_candidates(dtype, t):
    cands = MOE_FP8_CANDIDATES if dtype == "fp8_w8a8" else MOE_BF16_CANDIDATES
    per_expert = t * TOP_K / E
    max_bm = 16 if per_expert <= 1 else 32 if per_expert <= 4 else 64
    return [c for c in cands if c["BLOCK_SIZE_M"] <= max_bm]


def set_tp(tp: int) -> None:
    """Point the MoE shard and the GEMM shapes at tensor-parallel size `tp` (module constants; the
    default 8 keeps the first run's six shapes and names)."""
    global N_SHARD, GEMM_SHAPES
    if tp == 8:
        return
    from tuning.shapes import gemm_shapes, load_model_config

    N_SHARD = 2048 // tp
    GEMM_SHAPES = {f"{'+'.join(s.layers)} {s.K}->{s.N}": (s.N, s.K)
                   for s in gemm_shapes(load_model_config("deepseek-v3"), tp=tp)}


def with_tuned(default: dict, tuned: dict) -> list:
    """--quick candidates: the default, and the shipped tuned config when it differs."""
    return [default] + ([tuned] if tuned != default else [])


def bench_moe(ceil, quick):
    rows, best_cfgs = [], {}
    for dtype in MOE_DTYPES:
        fp8 = dtype == "fp8_w8a8"
        log(f"\n## fused MoE {dtype}: E={E} K={HIDDEN} N={N_SHARD} top-{TOP_K}")
        w13, w2, s13, s2 = moe_weights(fp8, seed=3)
        best_cfgs[dtype] = {}
        for t in MOE_BATCHES:
            rot = MOE_ROTATIONS
            sets = [routing(t, seed=1000 * t + r) for r in range(rot)]
            xs = [torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16) for _ in range(rot)]
            touched = statistics.mean(int(ids.unique().numel()) for ids, _ in sets)
            floor_us = touched * expert_bytes(fp8) / (ceil["copy_gbps"] * 1e3)

            def fns(c):
                return [lambda i=i: fused_moe(xs[i], w13, w2, sets[i][0], sets[i][1], w13_scale=s13, w2_scale=s2,
                                              config=c) for i in range(rot)]

            default = tc.default_moe_config(t, E, N_SHARD, TOP_K, dtype)
            tuned = tc.get_moe_config(E, N_SHARD, t, TOP_K, dtype)
            results = sweep(fns, with_tuned(default, tuned) if quick else [default] + moe_candidates(dtype, t),
                            f"T={t}")
            default_us = results[0][0]
            best_us, best = min(results, key=lambda r: r[0])
            eager_us = do_bench(fns(best)[0], warmup=10, rep=40, return_mode="median") * 1e3
            best_cfgs[dtype][t] = best
            row = dict(kernel=f"fused_moe {dtype}", batch=t, experts_touched=touched, floor_us=floor_us,
                       default_us=default_us, best_us=best_us, eager_us=eager_us,
                       pct_floor=100 * floor_us / best_us, gbps=touched * expert_bytes(fp8) / best_us / 1e3,
                       best_config=best)
            rows.append(row)
            log(f"  T={t:4d} experts={touched:6.1f} floor={floor_us:7.1f}us default={default_us:7.1f}us "
                f"best={best_us:7.1f}us ({row['pct_floor']:5.1f}% of floor, {row['gbps']:.0f} GB/s) "
                f"eager={eager_us:7.1f}us best={json.dumps(best, separators=(',', ':'))}")
        w13 = w2 = s13 = s2 = None  # free the memory (the lambdas above still name them)
        torch.cuda.empty_cache()
    return rows, best_cfgs


# --------------------------------------------------------------------------- block GEMM timing


def bench_gemm(ceil, quick):
    rows, best_cfgs = [], {}
    log("\n## block-FP8 GEMM vs torch bf16 (cuBLAS)")
    for name, (n, k) in GEMM_SHAPES.items():
        rot = max(1, min(MOE_ROTATIONS, math.ceil(256e6 / (n * k * 2))))
        ws = [block_weights(n, k, seed=r) for r in range(rot)]
        wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(rot)]
        best_cfgs[(n, k)] = {}
        for m in GEMM_MS:
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            bf16_us = graph_ms([lambda i=i: a @ wb[i].T for i in range(rot)]) * 1e3
            default = tc.default_fp8_gemm_config(m, n, k)
            cands = GEMM_SMALL_CANDIDATES if m <= 64 else GEMM_LARGE_CANDIDATES
            def fns(c):
                return [lambda i=i: block_fp8_matmul(a, ws[i][0], ws[i][1], config=c) for i in range(rot)]

            cands = [c for c in cands if not c.get("CUBLAS") or cublas_block_fp8_supported(DEV, k=k)]
            tuned = tc.get_fp8_gemm_config(n, k, m)
            results = sweep(fns, with_tuned(default, tuned) if quick else [default] + cands, f"{name} M={m}")
            default_us = results[0][0]
            best_us, best = min(results, key=lambda r: r[0])
            aq, a_s = per_token_group_quant_fp8(a, column_major_scales=True)
            gemm_only_us = graph_ms([lambda i=i: block_fp8_matmul_q(aq, a_s, ws[i][0], ws[i][1], config=best)
                                     for i in range(rot)]) * 1e3
            flops = 2 * m * n * k
            bytes_ = n * k + m * k * 2 + m * n * 2
            floor_us = max(bytes_ / (ceil["copy_gbps"] * 1e3), flops / (ceil["fp8_tflops"] * 1e6)
                           if not math.isnan(ceil["fp8_tflops"]) else 0.0)
            best_cfgs[(n, k)][m] = best
            row = dict(kernel="block_fp8_gemm", shape=name, N=n, K=k, M=m, bf16_us=bf16_us, default_us=default_us,
                       best_us=best_us, gemm_only_us=gemm_only_us, floor_us=floor_us,
                       speedup=bf16_us / best_us, tflops=flops / best_us / 1e6, best_config=best)
            rows.append(row)
            log(f"  {name:24s} M={m:5d} bf16={bf16_us:8.1f}us fp8 default={default_us:8.1f} best={best_us:8.1f} "
                f"(gemm only {gemm_only_us:8.1f}) floor={floor_us:7.1f} speedup={row['speedup']:.2f}x "
                f"{row['tflops']:.0f} TFLOP/s best={json.dumps(best, separators=(',', ':'))}")
        ws = wb = None  # free the memory (the lambdas above still name them)
        torch.cuda.empty_cache()
    return rows, best_cfgs


def moe_breakdown(configs):
    """Per-kernel device time of fused_moe (torch.profiler / CUPTI), fp8, at a few batch sizes."""
    log("\n## fused MoE fp8 per-kernel breakdown (profiler, mean of 20 eager calls)")
    rows = []
    w13, w2, s13, s2 = moe_weights(True, seed=3)
    for t in (1, 64, 512):
        c = configs.get(t) or tc.default_moe_config(t, E, N_SHARD, TOP_K, "fp8_w8a8")
        ids, wts = routing(t, seed=77)
        x = torch.randn(t, HIDDEN, device=DEV, dtype=torch.bfloat16)
        for _ in range(3):
            fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, config=c)
        torch.cuda.synchronize()
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fused_moe(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, config=c)
                torch.cuda.synchronize()
            parts = []
            for ev in prof.key_averages():
                total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if total:
                    parts.append((ev.key[:40], total / 20))
            parts.sort(key=lambda p: -p[1])
            busy = sum(p[1] for p in parts)
            log(f"  T={t}: kernels busy {busy:.1f}us per call: " + "; ".join(f"{k} {v:.1f}" for k, v in parts))
            rows.append(dict(batch=t, busy_us=busy, parts=parts, config=c))
        except Exception as exc:  # noqa: BLE001
            log(f"  profiler failed: {type(exc).__name__}: {exc}")
    del w13, w2
    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- small kernels


def bench_small(ceil):
    rows = []
    log("\n## router, align, quant, fp8_bmm")
    for t in SMALL_BATCHES:
        g = torch.Generator(device=DEV).manual_seed(t)
        logits, bias = torch.randn(t, E, device=DEV, generator=g), torch.randn(E, device=DEV, generator=g) * 0.1
        kw = dict(top_k=8, method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                  correction_bias=bias)
        us = graph_ms([lambda: moe_gate(logits, **kw)]) * 1e3
        ref_us = graph_ms([lambda: moe_gate_ref(logits, **kw)]) * 1e3
        ids, _ = moe_gate(logits, **kw)
        align_us = graph_ms([lambda: moe_align_block_size(ids, 16, E)]) * 1e3
        rows.append(dict(kernel="moe_gate noaux_tc", batch=t, us=us, torch_us=ref_us))
        rows.append(dict(kernel="moe_align bm=16", batch=t, us=align_us))
        log(f"  T={t:5d} moe_gate {us:6.1f}us (torch {ref_us:6.1f}us)  moe_align {align_us:6.1f}us")
    for m in SMALL_BATCHES[:1] + SMALL_BATCHES[2:]:
        x = torch.randn(m, HIDDEN, device=DEV, dtype=torch.bfloat16)
        us = graph_ms([lambda: per_token_group_quant_fp8(x, column_major_scales=True)]) * 1e3
        floor = m * HIDDEN * 3 / (ceil["copy_gbps"] * 1e3)
        rows.append(dict(kernel="per_token_group_quant", batch=m, us=us, floor_us=floor))
        log(f"  quant M={m:5d} K={HIDDEN}: {us:6.1f}us (floor {floor:.1f}us)")
    for h in MLA_HEADS:
        kvb, kvb_s = block_weights(h * 256, 512, seed=h)
        view, sview = kvb.view(h, 256, 512), kvb_s.view(h, 2, 4)
        w_uk, s_uk = view[:, :128, :], sview[:, :1, :]
        w_uk_bf = (w_uk.float() * expand_block_scale(s_uk, 128, 512, (128, 128))).bfloat16()
        for m in (1, 32, 128):
            q = torch.randn(h, m, 128, device=DEV, dtype=torch.bfloat16)
            bf_us = graph_ms([lambda: torch.bmm(q, w_uk_bf)] * 4) * 1e3
            times = []
            for bm, bn in BMM_CANDIDATES:
                t_us = graph_ms([lambda: fp8_bmm(q, w_uk, s_uk, block_m=bm, block_n=bn)] * 4) * 1e3
                times.append((t_us, bm, bn))
            default_us = graph_ms([lambda: fp8_bmm(q, w_uk, s_uk)] * 4) * 1e3
            best = min(times)
            rows.append(dict(kernel=f"fp8_bmm W_UK H={h}", batch=m, us=default_us, best_us=best[0],
                             best=best[1:], torch_us=bf_us))
            log(f"  fp8_bmm W_UK H={h} M={m}: default {default_us:6.1f}us, best {best[0]:6.1f}us (block_m, block_n)="
                f"{best[1:]} (torch bf16 bmm {bf_us:6.1f}us); all: "
                + ", ".join(f"{bm}x{bn}:{t_us:.1f}" for t_us, bm, bn in times))
    return rows


# --------------------------------------------------------------------------- report


def tables(ceil, moe_rows, gemm_rows, small_rows):
    out = [f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}",
           f"Measured: copy {ceil['copy_gbps']:.0f} GB/s (read+write), bf16 cuBLAS {ceil['bf16_tflops']:.0f} "
           f"TFLOP/s, fp8 _scaled_mm {ceil['fp8_tflops']:.0f} TFLOP/s (8192^3)", ""]
    if moe_rows:
        out += ["| fused MoE | batch | experts touched | floor us | default us | best us | % of floor | GB/s "
                "| eager us | best config |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in moe_rows:
            cs = cfg_str(r["best_config"])
            out.append(f"| {r['kernel']} | {r['batch']} | {r['experts_touched']:.1f} | {r['floor_us']:.1f} | "
                       f"{r['default_us']:.1f} | {r['best_us']:.1f} | {r['pct_floor']:.0f}% | {r['gbps']:.0f} | "
                       f"{r['eager_us']:.1f} | {cs} |")
        out.append("")
    if gemm_rows:
        out += ["| GEMM (N x K) | M | bf16 cuBLAS us | fp8 default us | fp8 best us | fp8 GEMM only us | floor us "
                "| speed-up vs bf16 | TFLOP/s | best config |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in gemm_rows:
            c = r["best_config"]
            cs = "cuBLASLt" if c.get("CUBLAS") else cfg_str(c)
            out.append(f"| {r['shape']} | {r['M']} | {r['bf16_us']:.1f} | {r['default_us']:.1f} | "
                       f"{r['best_us']:.1f} | {r['gemm_only_us']:.1f} | {r['floor_us']:.1f} | {r['speedup']:.2f}x | "
                       f"{r['tflops']:.0f} | {cs} |")
        out.append("")
    if small_rows:
        out += ["| kernel | batch | us (default) | us (best swept) | torch us / floor us |",
                "|---|---:|---:|---:|---:|"]
        for r in small_rows:
            other = r.get("torch_us", r.get("floor_us"))
            best = r.get("best_us")
            out.append(f"| {r['kernel']} | {r['batch']} | {r['us']:.1f} | "
                       f"{'' if best is None else f'{best:.1f} {r.get(BEST_KEY)}'} | "
                       f"{'' if other is None else f'{other:.1f}'} |")
    return "\n".join(out)


def main():
    global LOG
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/bench_moe_fp8"))
    p.add_argument("--sections", default="ceil,check,moe,gemm,small")
    p.add_argument("--quick", action="store_true", help="the default and the shipped tuned config only (no sweep)")
    p.add_argument("--tp", type=int, default=8, choices=(1, 2, 4, 8), help="the MoE shard and GEMM shapes' TP")
    p.add_argument("--moe-batches", default=None, help="comma list (default: 1..512)")
    p.add_argument("--moe-dtypes", default=None, help="fp8_w8a8 and / or bf16 (default: both)")
    p.add_argument("--gemm-ms", default=None, help="comma list of GEMM M (default: 1..8192)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_fp8 needs a CUDA GPU")
    set_tp(args.tp)
    global MOE_BATCHES, MOE_DTYPES, GEMM_MS
    MOE_BATCHES = [int(x) for x in args.moe_batches.split(",")] if args.moe_batches else MOE_BATCHES
    MOE_DTYPES = tuple(args.moe_dtypes.split(",")) if args.moe_dtypes else MOE_DTYPES
    GEMM_MS = [int(x) for x in args.gemm_ms.split(",")] if args.gemm_ms else GEMM_MS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG = open(out / "log.txt", "w")
    sections = set(args.sections.split(","))
    t0 = time.time()
    log(f"# bench_moe_fp8 on {torch.cuda.get_device_name()} ({tc.device_name()}), torch {torch.__version__}, "
        f"triton {triton.__version__}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    ceil = ceilings()  # the floors need them
    moe_rows, gemm_rows, small_rows, configs = [], [], [], {}
    if "check" in sections:
        try:
            checks()
        except Exception:  # noqa: BLE001
            FAILURES.append("checks crashed")
            log(traceback.format_exc())
    dev = tc.device_name()
    breakdown, best_moe = [], {}
    if "moe" in sections:
        moe_rows, best = bench_moe(ceil, args.quick)
        best_moe = best["fp8_w8a8"]
        for dtype, per_m in best.items():
            fname = tc.moe_config_filename(E, N_SHARD, dev, dtype, (128, 128) if dtype == "fp8_w8a8" else None)
            configs[fname] = {str(m): c for m, c in per_m.items()}
    if "gemm" in sections:
        gemm_rows, best = bench_gemm(ceil, args.quick)
        for (n, k), per_m in best.items():
            configs[tc.fp8_gemm_config_filename(n, k, dev)] = {str(m): c for m, c in per_m.items()}
    if "moe" in sections:
        breakdown = moe_breakdown(best_moe)
    if "small" in sections:
        small_rows = bench_small(ceil)
    report = tables(ceil, moe_rows, gemm_rows, small_rows)
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(json.dumps(dict(device=dev, ceilings=ceil, moe=moe_rows, gemm=gemm_rows,
                                                      small=small_rows, breakdown=breakdown, configs=configs,
                                                      failures=FAILURES),
                                                 indent=1))
    log("\n" + report)
    from kernels import fp8 as _fp8
    from kernels import fused_moe as _moe
    from kernels.occupancy import report_lines
    log("\nkernel resources (every specialisation this run compiled; occupancy by sm_90 limits)\n" + "\n".join(
        report_lines({"fused_moe gemm": _moe._moe_gemm_kernel, "block_fp8_gemm": _fp8._block_fp8_gemm_kernel,
                      "fp8_bmm": _fp8._fp8_bmm_kernel})))
    log(f"\nchecks failed: {FAILURES if FAILURES else 'none'}; total {time.time() - t0:.0f}s")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
