#!/usr/bin/env bash
# Speculative decoding on a lent GPU machine: its GPU tests and the benchmark tables of docs/perf.md.
#   bash benchmarks/spec_gpu.sh tests        # spec on/off greedy identity under CUDA graphs + torch.compile
#   bash benchmarks/spec_gpu.sh flashinfer   # the FlashInfer backend's GPU tests (the spec case included)
#   bash benchmarks/spec_gpu.sh bench tiny   # V3 shapes (3 and 5 layers, projected to 61), trained tiny-py tok/s
#   bash benchmarks/spec_gpu.sh profile      # where a spec step's time goes (tiny-py batch 8, V3 5 layers batch 1)
# Logs go to $OUT. FlashInfer needs the bundle of benchmarks/flashinfer_bundle.sh in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for stage in "$@"; do
    case $stage in
        tests) timeout 420 python3 -m pytest tests/gpu/test_spec_gpu.py tests/gpu/test_cuda_paths.py::test_graph_and_compile_match_eager_greedy -q -s -rs \
                   2>&1 | tee "$OUT/spec_gpu_tests.log" | grep -E "accepted length|passed|failed|Error|assert" ;;
        flashinfer) OUT=$OUT bash benchmarks/flashinfer_gpu.sh >/dev/null 2>&1  # install the bundle, JIT-build
                    PYTHONPATH=/tmp/fi-site:$PWD FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws \
                        timeout 300 python3 -m pytest tests/gpu/test_flashinfer.py -q -s -rs -k "spec or graph or used" \
                        2>&1 | tee "$OUT/spec_flashinfer.log" | grep -E "passed|failed|Error|assert" | tail -8 ;;
        bench) TREES=${TREES:-2,4,4 3,1,4 2,1,3}
               timeout 280 python3 benchmarks/bench_spec.py --num-layers 3 --trees $TREES --json "$OUT/bench_spec_l3.json" \
                   > "$OUT/bench_spec_l3.log" 2>&1 || tail -5 "$OUT/bench_spec_l3.log"
               timeout 300 python3 benchmarks/bench_spec.py --num-layers 5 --trees $TREES --project "$OUT/bench_spec_l3.json" \
                   2>&1 | tee "$OUT/bench_spec_l5.log" | grep -v -E "^(INFO|WARNING)" | tail -42 ;;
        tiny) timeout 200 python3 benchmarks/bench_spec.py --model tiny-py --load-format auto --tok-s-only --num-layers 3 \
                  --batch-size 1 8 32 --output-len 128 --input-len 64 2>&1 | tee "$OUT/bench_spec_tiny.log" | tail -6 ;;
        profile) timeout 120 python3 benchmarks/profile_spec_step.py --model tiny-py --batch-size 8 \
                     > "$OUT/profile_spec_tiny.log" 2>&1; grep -A 30 "spec step" "$OUT/profile_spec_tiny.log" | head -32
                 timeout 200 python3 benchmarks/profile_spec_step.py --model deepseek-v3 --load-format dummy \
                     --num-layers 5 --batch-size 1 > "$OUT/profile_spec_v3.log" 2>&1; grep "spec step" "$OUT/profile_spec_v3.log" ;;
        *) echo "unknown stage $stage (tests, flashinfer, bench, tiny, profile)"; exit 2 ;;
    esac
done
