#!/usr/bin/env bash
# Tune the kernel configs a ONE-GPU deployment reads (issue 16, target 7), within a time budget.
#
#   OUT=/some/dir JOBS=moe bash benchmarks/tune_one_gpu.sh     (from the repository root)
#   OUT=/some/dir JOBS=fp8 bash benchmarks/tune_one_gpu.sh
#
# JOBS=moe: fused MoE of DeepSeek-V3 at TP 1 (E=256, N=2048, fp8_w8a8), DeepSeek-V3's EP-8 local
#           experts (E=32, N=2048, fp8_w8a8: `--tp 8 --ep-size 8`, also one rank of DP attention with
#           EP), DeepSeek-V2-Lite at TP 1 (E=64, N=1408, bf16).
# JOBS=fp8: the block-FP8 GEMM shapes of DeepSeek-V3 at TP 1 that no shipped file covers yet
#           ($FP8_SHAPES; q_a / kv_a / shared-expert down are shared with TP 8 and shipped).
# Each job runs under a hard `timeout` with --resume (rerun the same command to finish a job that ran
# out of time). Outputs: $OUT/configs/*.json (copy into kernels/configs/), $OUT/results/*.results.json,
# $OUT/logs/, the same two folders packed in $OUT/tuned.tgz, and last a summary table
# (benchmarks/tune_summary.py).
#
# Knobs (env): MOE_S / FP8_S (seconds per MoE shape / per GEMM shape; defaults 150 / 40), BATCH_SIZES
# (default 1,2,4,8,16,32,64,128,256,512,1024,2048,4096: the engine takes the nearest tuned M),
# FP8_SHAPES, FP8_TP (default 1), MAX_CONFIGS (cap per search stage), WORKERS, PYTHON.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/tune-out}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-moe fp8}
MOE_S=${MOE_S:-150}
FP8_S=${FP8_S:-40}
GRACE=${GRACE_S:-30}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096}
FP8_SHAPES=${FP8_SHAPES:-24576x1536,32768x512,7168x16384,36864x7168,7168x18432,4096x7168}
FP8_TP=${FP8_TP:-1}  # the TP the GEMM shapes belong to (FP8_TP=8 FP8_SHAPES=4096x512: kv_b_proj at TP 8)
WORKERS=${WORKERS:-0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=${COLUMNS:-160} PYTHONUNBUFFERED=1
mkdir -p "$OUT/configs" "$OUT/results" "$OUT/logs"
START=$(date +%s)
STATUS="$OUT/logs/stages.tsv"
touch "$STATUS"

run_job() {  # run_job NAME LIMIT_S ARGS...
    local name=$1 limit=$2; shift 2
    local t0 rc
    t0=$(date +%s)
    echo "=== [$name] start at +$(( t0 - START )) s, hard limit $((limit + GRACE)) s: dsctl $*" | tee -a "$OUT/logs/$name.log"
    timeout -k 15 -s INT $((limit + GRACE)) "$PYTHON" -m dsctl "$@" --out-dir "$OUT/configs" \
        --report-dir "$OUT/results" --workers "$WORKERS" --batch-sizes "$BATCH_SIZES" --time-limit "$limit" \
        --resume ${MAX_CONFIGS:+--max-configs "$MAX_CONFIGS"} 2>&1 | tail -n 40 >> "$OUT/logs/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== [$name] exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/logs/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STATUS"
    # one archive too: file names with '=', ',' and spaces do not survive every file transfer
    tar czf "$OUT/tuned.tgz" -C "$OUT" configs results
}

"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name())' \
    | tee "$OUT/logs/env.log"
for job in $JOBS; do
  case $job in
  moe)
    run_job moe-v3-tp1 "$MOE_S" tune-moe --model deepseek-v3 --tp 1 --dtype fp8_w8a8
    run_job moe-v3-ep8 "$MOE_S" tune-moe --model deepseek-v3 --tp 8 --ep 8 --dtype fp8_w8a8
    run_job moe-v2lite-tp1 "$MOE_S" tune-moe --model deepseek-v2-lite --tp 1 --dtype bf16
    ;;
  fp8)
    for shape in ${FP8_SHAPES//,/ }; do
      run_job "fp8-$shape" "$FP8_S" tune-fp8 --model deepseek-v3 --tp "$FP8_TP" --shapes "$shape"
    done
    ;;
  esac
done
rm -f "$OUT"/configs/*.tmp
"$PYTHON" benchmarks/tune_summary.py "$OUT" $(( $(date +%s) - START )) 2>&1 | tee "$OUT/summary.txt"
