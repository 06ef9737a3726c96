"""Shared memory of the attention kernels' default configs, compiled for sm_90 on this (CPU) machine with
programmatic dependent launch (each must then wait for the kernel before it: `griddepcontrol.wait` in its PTX); and
the small fused kernels of the decode step (kernels/mla_rope_cache.py, kernels/silu_mul_quant.py, the norms, the
block-FP8 GEMM and the fused-MoE GEMM with their split-K reduction) compiled the same way, because Triton's CPU interpreter runs code its GPU compiler refuses (e.g. a variable of two shapes in the two
branches of an `if`, which reached a GPU once).

Run as `python -m tests.kernels.smem_probe` without TRITON_INTERPRET (the test suite sets it, and an
interpreted kernel cannot be compiled): prints one JSON object, case name -> bytes. Used by
tests/kernels/test_shared_memory.py.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from kernels import (
    fp8,
    fused_moe,
    mla_decode,
    mla_extend,
    mla_rope_cache,
    moe_gate,
    rms_norm,
    rms_norm_quant,
    silu_mul_quant,
)

_TL = {torch.float32: ("fp32", tl.float32), torch.bfloat16: ("bf16", tl.bfloat16)}
DECODE_ROWS = (16, 32, 128)  # V2-Lite / TP-8 V3, 16 heads x 2 draft rows, DP-attention V3 at 128 heads
EXTEND_DIMS = (192, 128)  # DeepSeek's qk (nope + rope) and v head dims


def _compile_sm90(fn, signature: dict, constexprs: dict, cfg=None, **options) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs, PDL=True)  # as the engine launches them on a Hopper GPU (kernels/pdl.py)
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    if cfg is not None:
        options.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(options, launch_pdl=True))
    if "griddepcontrol.wait" not in kernel.asm["ptx"]:
        raise AssertionError(f"{fn.__name__} compiled with PDL has no griddepcontrol.wait")
    return kernel.metadata.shared


def rope_cache_bytes(cache: str, write: bool) -> int:
    """kernels/mla_rope_cache.py at DeepSeek-V3's shapes (bf16 activations, 128 heads)."""
    block, rows, warps = mla_rope_cache.rms_norm_launch_meta(512)
    sig = {n: "*bf16" for n in ("Q", "L", "W", "QPE", "CKV", "KPE")}
    sig.update(COS="*fp32", SIN="*fp32", POS="*i64", CACHE=f"*{cache}", SLOTS="*i64", eps="fp32", kv_scale="fp32")
    sig.update({n: "i32" for n in ("n_rows n_heads stride_qt stride_qh stride_l stride_c stride_ckv "
                                   "stride_kpe").split()})
    cons = dict(KV_LORA=512, NOPE=128, HALF=32, BLOCK=block, PAIRS=32, ROWS=rows, HEADS=16, WRITE_CACHE=write,
                CACHE_FP8=cache == "fp8e4nv", EXACT_ROUND=False)
    return _compile_sm90(mla_rope_cache._mla_rope_cache_kernel, sig, cons, num_warps=warps, enable_fp_fusion=False)


def norm_bytes(quant: bool, residual: bool) -> int:
    """kernels/rms_norm.py's and kernels/rms_norm_quant.py's kernels at V3's hidden size, with and without the
    residual add."""
    block, rows, warps = rms_norm.launch_meta(7168)
    sig = dict(X="*bf16", R="*bf16", W="*bf16", eps="fp32")
    ints = "n_rows hidden stride_x stride_r"
    cons = dict(BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual, EXACT_ROUND=False)
    if quant:
        sig.update(SUM="*bf16", Q="*fp8e4nv", S="*fp32", act_eps="fp32")
        ints += " stride_sum stride_q stride_sm stride_sg"
        cons.update(GROUP=128, NORM_DTYPE=tl.bfloat16)
        fn = rms_norm_quant._rms_norm_quant_kernel
    else:
        sig.update(S="*bf16", Out="*bf16")
        ints += " stride_s stride_o"
        fn = rms_norm._rms_norm_kernel
    sig.update({n: "i32" for n in ints.split()})
    return _compile_sm90(fn, sig, cons, num_warps=warps)


def silu_mul_quant_bytes() -> int:
    sig = dict(X="*bf16", Q="*fp8e4nv", S="*fp32", act_eps="fp32")
    sig.update({n: "i32" for n in "n_rows inter stride_x stride_q stride_sm stride_sg".split()})
    cons = dict(GROUP=128, GROUPS=silu_mul_quant.GROUPS_PER_PROGRAM, EXACT_ROUND=False)
    return _compile_sm90(silu_mul_quant._silu_mul_quant_kernel, sig, cons, num_warps=4)


def block_gemm_bytes(split_k: int, quant_a: bool) -> int:
    """kernels/fp8.py's block-FP8 GEMM as a decode step runs it (a 16 x 32 tile, 5 stages), with and without the
    split-K reduction (partials, arrival counts)."""
    sig = dict(a_ptr="*bf16" if quant_a else "*fp8e4nv", as_ptr="*bf16" if quant_a else "*fp32", b_ptr="*fp8e4nv",
               bs_ptr="*fp32", c_ptr="*bf16", ws_ptr="*fp32" if split_k > 1 else "*bf16",
               count_ptr="*i32" if split_k > 1 else "*bf16")
    sig.update({n: "i32" for n in ("M N K stride_am stride_ak stride_asm stride_asg stride_bn stride_bk "
                                   "stride_bsn stride_bsk stride_cm stride_cn").split()})
    cons = dict(GROUP_N=128, GROUP_K=128, QUANT_A=quant_a, BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128,
                GROUP_SIZE_M=1, SPLIT_K=split_k, EXACT_ROUND=False)
    return _compile_sm90(fp8._block_fp8_gemm_kernel, sig, cons, num_warps=4, num_stages=5)


def moe_gemm_bytes(split_k: int, gated: bool) -> int:
    """kernels/fused_moe.py's grouped GEMM (FP8, a 16 x 32 tile) with and without the split-K reduction."""
    sig = dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", b_ptr="*fp8e4nv", b_scale_ptr="*fp32", c_ptr="*bf16",
               topk_w_ptr="*fp32", sorted_ids_ptr="*i32", expert_ids_ptr="*i32", npp_ptr="*i32",
               ws_ptr="*fp32" if split_k > 1 else "*bf16", count_ptr="*i32" if split_k > 1 else "*bf16")
    sig.update({n: "i32" for n in ("N K num_valid num_pid_m up_offset stride_am stride_ak stride_asm stride_ask "
                                   "stride_be stride_bn stride_bk stride_bse stride_bsn stride_bsk "
                                   "stride_cm stride_cn").split()})
    cons = dict(A_ROW_DIV=2 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, USE_FP8=True, QUANT_A=False,
                INTERPRET=False, GROUP_N=128, GROUP_K=128, BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128,
                GROUP_SIZE_M=1, SPLIT_K=split_k)
    return _compile_sm90(fused_moe._moe_gemm_kernel, sig, cons, num_warps=4, num_stages=4)


def moe_gate_bytes(n_shared: int) -> int:
    """kernels/moe_gate.py's router top-k at V3's shape (noaux_tc, 256 experts in 8 groups, top-8), with and
    without the shared experts' columns."""
    sig = dict(logits_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", pad_ptr="*i8", P="i32", T="i32",
               E="i32", stride_lt="i32", scaling="fp32")
    cons = dict(TOP_K=8, N_GROUP=8, TOPK_GROUP=4, GROUP_SIZE=32, METHOD=0, SIGMOID=True, HAS_BIAS=True, NORM=True,
                N_SHARED=n_shared, HAS_PAD=True, BLOCK_T=8, BLOCK_E=256, BLOCK_G=8, BLOCK_K=16 if n_shared else 8)
    return _compile_sm90(moe_gate._moe_gate_kernel, sig, cons, num_warps=4)


def router_gate_bytes(block_t: int) -> int:
    """kernels/moe_gate.py's fused router (logits and gate in one launch) at V3's shape: 256 experts, hidden 7168,
    noaux_tc, block_t rows (the smallest and the largest fused batch)."""
    sig = dict(x_ptr="*bf16", gw_ptr="*fp32", ws_ptr="*fp32", count_ptr="*i32", bias_ptr="*fp32", w_ptr="*fp32",
               ids_ptr="*i32", pad_ptr="*i8", P="i32", T="i32", E="i32", H="i32", stride_xt="i32", stride_ge="i32",
               scaling="fp32")
    cons = dict(TOP_K=8, N_GROUP=8, TOPK_GROUP=4, GROUP_SIZE=32, METHOD=0, SIGMOID=True, HAS_BIAS=True, NORM=True,
                N_SHARED=0, HAS_PAD=True, BLOCK_T=block_t, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8, BLOCK_EW=16,
                BLOCK_H=max(32, min(256, moe_gate.ROUTER_TILE_PER_WARP * 4 // (block_t * 16))), SPLIT_H=8, PROGRAMS=128)
    return _compile_sm90(moe_gate._router_gate_kernel, sig, cons, num_warps=4)


def decode_bytes(rows: int, dtype: torch.dtype) -> int:
    cfg = mla_decode.default_config(rows, dtype)
    ptr, compute = _TL[dtype]
    sig = dict(QNope=f"*{ptr}", QRope=f"*{ptr}", KV=f"*{ptr}", KvScalePtr=f"*{ptr}", kv_scale_val="fp32",
               ReqToToken="*i32", ReqPool="*i64", SeqLens="*i32", MidO="*fp32", MidLse="*fp32", Out=f"*{ptr}",
               qk_scale_log2="fp32", max_splits="i32", min_split_tokens="i32")
    sig.update({n: "i32" for n in ("stride_qn_b stride_qn_h stride_qr_b stride_qr_h stride_kv stride_rtt "
                                   "stride_mo_b stride_mo_h stride_mo_s stride_ml_b stride_ml_h "
                                   "stride_o_b stride_o_h").split()})
    cons = dict(H=rows, Q_PER_REQ=1, LKV=512, R=64, BLOCK_LKV=512, BLOCK_R=64, BLOCK_H=cfg.block_h,
                BLOCK_N=cfg.block_n, SCALE_PTR=False, KV_LOAD=mla_decode.KV_LOADS[cfg.kv_load], DIRECT_OUT=False,
                COMPUTE_DTYPE=compute, INTERPRET=False)
    return _compile_sm90(mla_decode._mla_decode_stage1, sig, cons, cfg)


def extend_bytes(dtype: torch.dtype) -> int:
    dqk, dv = EXTEND_DIMS
    cfg = mla_extend.default_config(dqk, dv, torch.device("cuda"), dtype.itemsize)
    ptr, compute = _TL[dtype]
    d1, d2 = mla_extend._split_dim(dqk)
    sig = {n: f"*{ptr}" for n in ("Q", "K", "V", "KP", "VP", "Out")}
    sig.update(CuExt="*i32", CuPre="*i32", qk_scale="fp32")
    sig.update({f"stride_{t}_{d}": "i32" for t in ("q", "k", "v", "kp", "vp", "o") for d in ("t", "h")})
    cons = dict(D1=d1, D2=d2, BLOCK_D2=max(16, triton.next_power_of_2(d2)), HAS_D2=d2 > 0, DV=dv,
                BLOCK_DV=triton.next_power_of_2(dv), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                COMPUTE_DTYPE=compute, INTERPRET=False, MASK_DIAG_ONLY=cfg.mask_diag_only)
    return _compile_sm90(mla_extend._extend_fwd, sig, cons, cfg)


def main() -> None:
    out = {}
    for dtype in _TL:
        name = _TL[dtype][0]
        for rows in DECODE_ROWS:
            out[f"mla_decode {rows} rows {name}"] = decode_bytes(rows, dtype)
        out[f"mla_extend {name}"] = extend_bytes(dtype)
    for cache, write in (("bf16", True), ("fp8e4nv", True), ("bf16", False)):
        out[f"mla_rope_cache {cache} cache{'' if write else ' unwritten'}"] = rope_cache_bytes(cache, write)
    out["silu_mul_quant bf16"] = silu_mul_quant_bytes()
    for quant in (False, True):
        for residual in (False, True):
            out[f"rms_norm{' quant' if quant else ''}{' + residual' if residual else ''}"] = norm_bytes(quant, residual)
    for split_k, quant_a in ((1, False), (4, False), (4, True)):
        out[f"block_fp8_gemm split {split_k}{' quant' if quant_a else ''}"] = block_gemm_bytes(split_k, quant_a)
    for n_shared in (0, 1):
        out[f"moe_gate shared {n_shared}"] = moe_gate_bytes(n_shared)
    for block_t in (2, 4):
        out[f"router_gate rows {block_t}"] = router_gate_bytes(block_t)
    for split_k, gated in ((1, True), (4, True), (4, False)):
        out[f"moe_gemm split {split_k}{' gated' if gated else ''}"] = moe_gemm_bytes(split_k, gated)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
