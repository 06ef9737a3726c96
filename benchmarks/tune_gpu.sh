#!/usr/bin/env bash
# Tune DeepSeek-V3 TP8 kernel configs on one GPU within a time budget (default 420 s), non-interactively.
#
#   OUT=/some/dir bash benchmarks/tune_gpu.sh        (run from the repository root; $OUT defaults to ./tune-out)
#
# Stages (each independent: a failing or timed-out stage does not stop the next; every stage writes
# into $OUT as it goes, and each batch size's result is saved the moment it is tuned):
#   0. environment + dry-run plans                          -> $OUT/logs/0-*.log
#   1. tune-moe fp8_w8a8, V3 TP8 (E=256, N=256), SGLang's 18 batch sizes; prints total tuning time
#   2. tune-fp8 for $FP8_SHAPES (V3 TP8 block-FP8 GEMMs), SGLang's batch sizes
#   3. --verify-exhaustive on $VERIFY_BS: the staged pick vs the exhaustive grid (fused MoE)
#   4. summary: tuned-vs-default speed-ups, verify verdict, stage times -> $OUT/summary.txt
# Outputs: $OUT/configs/*.json  (copy into kernels/configs/; only config files land there)
#          $OUT/results/*.results.json, $OUT/verify/verify-*.json, $OUT/logs/*.log, $OUT/summary.txt
#
# Knobs (env): TUNE_BUDGET_S (total seconds, default 420), MOE_S / FP8_S (stage budgets; default 40% / 25%
# of the budget, the rest to stage 3), FP8_SHAPES (default 1536x7168,576x7168,7168x2048: q_a_proj,
# kv_a_proj_with_mqa, o_proj), VERIFY_BS (default 8,256,2048), MODEL (deepseek-v3), TP (8), BATCH_SIZES
# (default: SGLang's list), WORKERS (compile processes, default: one per core up to 16), PYTHON, GRID
# (staged; `tiny` + MODEL=<tiny checkpoint dir> is the CPU smoke run: TRITON_INTERPRET=1 bash ...),
# STAGES (default "0 1 2 3 4"), MAX_CONFIGS (cap per search stage; unset = no cap).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/tune-out}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-deepseek-v3}
TP=${TP:-8}
BUDGET=${TUNE_BUDGET_S:-420}
MOE_S=${MOE_S:-$((BUDGET * 40 / 100))}
FP8_S=${FP8_S:-$((BUDGET * 25 / 100))}
FP8_SHAPES=${FP8_SHAPES:-1536x7168,576x7168,7168x2048}
VERIFY_BS=${VERIFY_BS:-8,256,2048}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096}
WORKERS=${WORKERS:-0}
GRID=${GRID:-staged}
STAGES=${STAGES:-0 1 2 3 4}
GRACE=${GRACE_S:-45}  # a stage may finish the batch size it started after its time limit
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" COLUMNS=${COLUMNS:-160} PYTHONUNBUFFERED=1
mkdir -p "$OUT/configs" "$OUT/results" "$OUT/verify" "$OUT/logs"
START=$(date +%s)
STATUS="$OUT/logs/stages.tsv"
: > "$STATUS"
N_FP8=$(echo "$FP8_SHAPES" | tr ',' '\n' | grep -c .)

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }

# run_stage NAME LIMIT_S CMD...: hard wall-clock limit (SIGINT, then SIGKILL), log, status line
run_stage() {
    local name=$1 limit=$2; shift 2
    local t0 rc
    t0=$(date +%s)
    echo "=== [$name] start at +$(elapsed) s, hard limit ${limit} s: $*" | tee -a "$OUT/logs/$name.log"
    timeout -k 15 -s INT "$limit" "$@" 2>&1 | tee -a "$OUT/logs/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== [$name] exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/logs/$name.log"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STATUS"
}

DSCTL=("$PYTHON" -m dsctl)
common=(--model "$MODEL" --tp "$TP" --out-dir "$OUT/configs" --report-dir "$OUT/results" --grid "$GRID"
        --workers "$WORKERS" ${MAX_CONFIGS:+--max-configs "$MAX_CONFIGS"})

for stage in $STAGES; do
  case $stage in
  0)
    {
      date; hostname; nvidia-smi || true
      "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
      echo "budget ${BUDGET} s: moe ${MOE_S} s, fp8 ${FP8_S} s (${N_FP8} shapes), verify: the rest"
    } 2>&1 | tee "$OUT/logs/0-env.log"
    run_stage 0-plan 120 "${DSCTL[@]}" tune-moe "${common[@]}" --batch-sizes "$BATCH_SIZES" --dry-run \
        --verify-exhaustive "$VERIFY_BS"
    run_stage 0-plan-fp8 120 "${DSCTL[@]}" tune-fp8 "${common[@]}" --shapes "$FP8_SHAPES" --batch-sizes "$BATCH_SIZES" --dry-run
    ;;
  1)
    # --resume: a rerun continues where a killed one stopped. Print the total tuning time.
    run_stage 1-moe $((MOE_S + GRACE)) "${DSCTL[@]}" tune-moe "${common[@]}" --dtype fp8_w8a8 --batch-sizes "$BATCH_SIZES" \
        --time-limit "$MOE_S" --resume
    ;;
  2)
    per=$(( FP8_S / (N_FP8 > 0 ? N_FP8 : 1) ))
    run_stage 2-fp8 $((FP8_S + GRACE)) "${DSCTL[@]}" tune-fp8 "${common[@]}" --shapes "$FP8_SHAPES" \
        --batch-sizes "$BATCH_SIZES" --time-limit "$per" --resume
    ;;
  3)
    rest=$(left)
    if [ "$rest" -lt 60 ]; then rest=60; fi  # always try at least one batch size
    run_stage 3-verify "$rest" "${DSCTL[@]}" tune-moe "${common[@]}" --dtype fp8_w8a8 --verify-exhaustive "$VERIFY_BS" \
        --time-limit $(( rest - GRACE > 0 ? rest - GRACE : 1 ))
    mv -f "$OUT"/configs/verify-*.json "$OUT/verify/" 2>/dev/null || true
    ;;
  4)
    "$PYTHON" benchmarks/tune_summary.py "$OUT" "$(elapsed)" 2>&1 | tee "$OUT/summary.txt"
    ;;
  esac
done
rm -f "$OUT"/configs/*.tmp
echo "total wall time $(elapsed) s; configs in $OUT/configs (progress files, if any, mean a stage stopped early:" \
     "rerun the same command to resume)"
