"""Shared memory of the attention kernels' default configs, compiled for sm_90 on this (CPU) machine.

Run as `python -m tests.kernels.smem_probe` without TRITON_INTERPRET (the test suite sets it, and an
interpreted kernel cannot be compiled): prints one JSON object, case name -> bytes. Used by
tests/kernels/test_shared_memory.py.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from kernels import mla_decode, mla_extend

_TL = {torch.float32: ("fp32", tl.float32), torch.bfloat16: ("bf16", tl.bfloat16)}
DECODE_ROWS = (16, 32, 128)  # V2-Lite / TP-8 V3, 16 heads x 2 draft rows, DP-attention V3 at 128 heads
EXTEND_DIMS = (192, 128)  # DeepSeek's qk (nope + rope) and v head dims


def _compile_sm90(fn, signature: dict, constexprs: dict, cfg) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return kernel.metadata.shared


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
    print(json.dumps(out))


if __name__ == "__main__":
    main()
