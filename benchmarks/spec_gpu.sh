#!/usr/bin/env bash
# Speculative decoding on a lent GPU machine: its GPU tests and the benchmark tables of docs/perf.md.
#   bash benchmarks/spec_gpu.sh tests        # spec on/off greedy identity under CUDA graphs + torch.compile
#   bash benchmarks/spec_gpu.sh flashinfer   # the FlashInfer backend's GPU tests (the spec case included)
#   bash benchmarks/spec_gpu.sh bench tiny   # V3 shapes (3 and 5 layers, projected to 61; ROUTING="random same"), tiny-py tok/s
#   bash benchmarks/spec_gpu.sh profile      # where a spec step's time goes (tiny-py batch 8, V3 5 layers batch 1)
#   bash benchmarks/spec_gpu.sh deep         # H200: V3 at 3 and 11 layers, random vs same routing, projected to 61
#   bash benchmarks/spec_gpu.sh tp4          # 4 GPUs: bench offline --tp 4, spec off / on (2x1x3), 3 and 21 layers
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
               ROUTING=${ROUTING:-random same}
               timeout 280 python3 benchmarks/bench_spec.py --num-layers 3 --trees $TREES --routing $ROUTING --cost-only \
                   --json "$OUT/bench_spec_l3.json" > "$OUT/bench_spec_l3.log" 2>&1 || tail -5 "$OUT/bench_spec_l3.log"
               timeout 330 python3 benchmarks/bench_spec.py --num-layers 5 --trees $TREES --routing $ROUTING \
                   --project "$OUT/bench_spec_l3.json" 2>&1 | tee "$OUT/bench_spec_l5.log" \
                   | grep -v -E "^(INFO|WARNING)|Triton compiled" | tail -75 ;;
        tiny) timeout 200 python3 benchmarks/bench_spec.py --model tiny-py --load-format auto --tok-s-only --num-layers 3 \
                  --batch-size 1 8 32 --output-len 128 --input-len 64 2>&1 | tee "$OUT/bench_spec_tiny.log" | tail -6 ;;
        profile) timeout 120 python3 benchmarks/profile_spec_step.py --model tiny-py --batch-size 8 \
                     > "$OUT/profile_spec_tiny.log" 2>&1; grep -A 30 "spec step" "$OUT/profile_spec_tiny.log" | head -32
                 timeout 200 python3 benchmarks/profile_spec_step.py --model deepseek-v3 --load-format dummy \
                     --num-layers 5 --batch-size 1 > "$OUT/profile_spec_v3.log" 2>&1; grep "spec step" "$OUT/profile_spec_v3.log" ;;
        deep) T="2,4,4 2,1,3 3,4,8"; G=1,2,4,8,16,32,64,128,256  # 11 layers + MTP: ~110 GB of weights
              timeout 200 python3 benchmarks/bench_spec.py --num-layers 3 --batch-size 1 8 32 --trees $T \
                  --routing random same --cost-only --cuda-graph-bs $G --json "$OUT/bench_spec_l3.json" \
                  > "$OUT/bench_spec_l3.log" 2>&1 || tail -5 "$OUT/bench_spec_l3.log"
              timeout 370 python3 benchmarks/bench_spec.py --num-layers 11 --batch-size 1 8 32 --trees $T \
                  --routing random same --cuda-graph-bs $G --json "$OUT/bench_spec_l11.json" \
                  --project "$OUT/bench_spec_l3.json" --tok-s-batch-size 32 --disable-by-batch-size 16 --output-len 128 \
                  2>&1 | tee "$OUT/bench_spec_l11.log" | grep -v -E "^(INFO|WARNING)|Triton compiled" | tail -62 ;;
        tp4) for layers in 3 21; do  # multi_gpu.sh's spec stage at TP 4, input 512, output 128
                 OUT=$OUT/tp4-$layers NGPU=4 LAYOUTS=tp4 LAYERS=$layers IN=512 OUTLEN=128 STAGES=spec \
                     SPEC_FLAGS="--cuda-graph-bs 1,2,4,8,16,32,64,96,128" bash benchmarks/multi_gpu.sh
             done ;;
        *) echo "unknown stage $stage (tests, flashinfer, bench, tiny, profile, deep, tp4)"; exit 2 ;;
    esac
done
