#!/usr/bin/env bash
# Every kernel benchmark in one command (one CUDA GPU, ~5 minutes): checks each Triton kernel against its
# torch reference at DeepSeek-V3 shapes, then times it next to its memory/compute floor.
#   OUT=/some/dir bash benchmarks/kernels.sh      -> $OUT/mla/bench_mla.json, $OUT/moe_fp8/{log.txt,results.md,results.json}
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
rc=0
python3 benchmarks/bench_mla.py --out "$OUT/mla" || rc=1            # MLA decode (16 / 128 heads, bf16 / FP8 KV) + extend
python3 benchmarks/bench_moe_fp8.py --out "$OUT/moe_fp8" || rc=1    # fused MoE, block-FP8 GEMM, gate, align, quant, FP8 bmm
exit $rc
