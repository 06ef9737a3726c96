#!/usr/bin/env bash
# A full-depth model on the GPUs of one call: `dsctl bench one-batch` per layout (batch 1 and 128 against the bytes
# floor), then `dsctl serve` through benchmarks/serve_sweep.sh: concurrency 1 (TPOT against the one-batch step) on
# the first start, and a second start alone (warm Triton cache), each with its ranks' start-up phases.
# Issue 35's rows at TP 2 on 2 x H200; MODEL / LAYERS / TP / EXTRA for others.
#   bash benchmarks/depth_ab.sh                          # V2 236B FP8, --tp 2, layouts: tp, tp + DP attention
#   LAYOUTS="tp sep" bash benchmarks/depth_ab.sh         # + --shared-experts-backend separate
#   MODEL=deepseek-v3 LAYERS=5 LAYOUTS=tp STAGES=onebatch bash benchmarks/depth_ab.sh
#   STAGES="onebatch" TREE=.peer/before bash ...          # another checkout's engine (its one-batch only)
#   BATCHES="1 32 128" CONCS="1 64 256" WARM=0 ...        # one-batch sizes, serving levels, no warm start
#   STAGES=serve CONCS= ...                               # start-up only (first start, then a warm one)
# Keeps few files under $OUT (a lent machine returns a limited number): one log and one JSONL per one-batch layout,
# the serving sweeps' files in one archive, and prints a table last. BUDGET_S bounds the whole run (each stage gets
# what is left).
set -u
OUT=${OUT:-$PWD/depth-out}; MODEL=${MODEL:-deepseek-v2}; LAYERS=${LAYERS:-full}; TP=${TP:-2}; TREE=${TREE:-.}
EXTRA=${EXTRA:-"--quantization fp8"}; LAYOUTS=${LAYOUTS:-"tp dp"}; STAGES=${STAGES:-"onebatch serve"}
BUDGET_S=${BUDGET_S:-570}; PORT=${PORT:-30555}; BATCHES=${BATCHES:-"1 128"}; CONCS=${CONCS-1}; WARM=${WARM:-1}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
layout_flags() {
    case $1 in
        tp) echo "--tp $TP" ;;
        dp) echo "--tp $TP --enable-dp-attention --dp $TP" ;;
        sep) echo "--tp $TP --shared-experts-backend separate" ;;
        ep) echo "--tp $TP --ep $TP" ;;
        *) echo "unknown layout $1" >&2; return 1 ;;
    esac
}
layers=""; [ "$LAYERS" != full ] && layers="--num-layers $LAYERS"

if [[ " $STAGES " == *" onebatch "* ]]; then
    for lay in $LAYOUTS; do
        [ "$(left)" -gt 60 ] || { say "no time left for one-batch $lay"; break; }
        # shellcheck disable=SC2046,SC2086
        timeout "$(left)" bash -c "cd '$TREE' && exec python3 -m dsctl bench one-batch --model $MODEL --load-format dummy \
            $layers $EXTRA $(layout_flags "$lay") --batch-size $BATCHES --input-len 256 --output-len 32 \
            --max-running-requests 128 --cuda-graph-bs ${BATCHES// /,} --result-file '$OUT/onebatch-$lay.jsonl'" \
            > "$OUT/onebatch-$lay.log" 2>&1
        say "one-batch $lay rc=$?"
        pkill -f "dsctl bench one-batch" 2>/dev/null; sleep 2
    done
fi

if [[ " $STAGES " == *" serve "* ]]; then
    sweep() {  # $1: tag, $2: concurrency levels ("" = start-up only)
        OUT="$OUT/serve" TAG=$1 CONCS=$2 MODEL=$MODEL LAYERS=$LAYERS LAYOUT=tp$TP EXTRA=$EXTRA TREE=$TREE PORT=$PORT \
            HEALTH_WAIT_S=$(( $(left) - 10 )) timeout "$(left)" bash benchmarks/serve_sweep.sh
        say "serve $1 rc=$?"
        pkill -f "dsctl serve" 2>/dev/null; sleep 2
        grep -hE "rank 0: weights|CUDA graphs:|piecewise CUDA|start-up:" "$OUT/serve/$1-serve.log" 2>/dev/null | cut -c1-300
    }
    [ "$(left)" -gt 60 ] && sweep first "$CONCS"  # the first start on this machine (cold Triton cache unless carried)
    [ "$WARM" = 1 ] && [ "$(left)" -gt 60 ] && sweep again ""  # warm
    tar czf "$OUT/serve.tgz" -C "$OUT" serve && rm -rf "$OUT/serve"
fi

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print(f"\n{'layout':>7} {'batch':>5} {'decode ms':>10} {'floor ms':>9} {'x floor':>8}")
for path in sorted(glob.glob(os.path.join(out, "onebatch-*.jsonl"))):
    for line in open(path):
        r = json.loads(line)
        lay = os.path.basename(path)[9:-6]
        print(f"{lay:>7} {r['batch_size']:>5} {r['median_decode_latency_s'] * 1e3:10.3f} "
              f"{r.get('decode_floor_ms') or float('nan'):9.3f} {r.get('decode_vs_floor') or float('nan'):8.2f}")
PY
