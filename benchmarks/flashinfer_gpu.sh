#!/usr/bin/env bash
# FlashInfer on a lent GPU machine (no network): install the bundle that benchmarks/flashinfer_bundle.sh
# packed into .whl/, JIT-build FlashInfer's MLA kernels once (all four variants in one parallel ninja run),
# then run the given stages. Each stage writes its log to $OUT.
#   bash benchmarks/flashinfer_gpu.sh tests kernels      # GPU tests of the backend, kernel table
#   bash benchmarks/flashinfer_gpu.sh decode throughput  # model decode step and offline throughput, triton vs flashinfer
#   stages: tests regress plan kernels decode throughput (see the case below)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
site=/tmp/fi-site
if [ ! -d "$site/flashinfer" ]; then
    mkdir -p "$site" && tar xJf .whl/flashinfer-*.tar.xz -C "$site" \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/apache_tvm_ffi-*.whl \
        || { echo "FlashInfer bundle install failed"; exit 1; }
fi
export PYTHONPATH="$site:$PWD" FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws} PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/flashinfer_build.log"
import time, torch, flashinfer
from flashinfer.jit.attention.modules import gen_batch_mla_module
from flashinfer.jit.core import build_jit_specs
t = time.time()
specs = [gen_batch_mla_module(b, torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False)
         for b in ("fa2", "fa3") for kv in (torch.bfloat16, torch.float8_e4m3fn)]
try:
    build_jit_specs(specs)
except Exception as e:  # fa3 may not build every dtype: build what can be built, one by one
    print("parallel build failed, building one at a time:", str(e)[-2000:])
    for s in specs:
        try:
            s.build()
        except Exception as e1:
            print("could not build", s.name, str(e1)[-1500:])
print(f"flashinfer {flashinfer.__version__}: MLA modules built in {time.time() - t:.0f} s on {torch.cuda.get_device_name()}")
PY
for stage in "$@"; do
    case "$stage" in
        tests) timeout 420 python3 -m pytest tests/gpu/test_flashinfer.py -q -s -rs 2>&1 | tee "$OUT/gpu_flashinfer_tests.log" ;;
        regress) timeout 420 python3 -m pytest tests/gpu/test_cuda_paths.py -q -s -rs 2>&1 | tee "$OUT/gpu_cuda_paths.log" ;;
        plan) timeout 120 python3 benchmarks/bench_flashinfer_mla.py --plan-only --out "$OUT" 2>&1 | tee "$OUT/bench_flashinfer_plan.log" ;;
        kernels) timeout 300 python3 benchmarks/bench_flashinfer_mla.py --out "$OUT" 2>&1 | tee "$OUT/bench_flashinfer_mla.log" ;;
        decode) timeout 480 python3 benchmarks/bench_decode.py --num-layers 5 --batch-sizes 1,8,32,128 \
                    --modes ${MODES:-eager,graph,compile} --kv-dtypes auto,fp8_e4m3 --attention-backends triton,flashinfer \
                    --no-per-layer --out "$OUT" 2>&1 | tee "$OUT/bench_decode.log" ;;
        throughput) timeout 420 python3 benchmarks/bench_offline_throughput.py --out "$OUT" 2>&1 \
                        | tee "$OUT/bench_offline_throughput.log" ;;
        *) echo "unknown stage $stage (tests, regress, plan, kernels, decode, throughput)"; exit 2 ;;
    esac
done
