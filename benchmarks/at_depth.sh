#!/usr/bin/env bash
# Several parallel layouts of one model at depth on the GPUs of one call (issue 42's runs): per layout, optionally
# `dsctl bench one-batch` (ONEBATCH_BS) against its bytes floor, then `dsctl serve` through
# benchmarks/serve_sweep.sh at CONCS (one server per layout, each start waiting for the GPUs to be idle); WARM=1
# starts the first layout once more at the end (start-up only, on the Triton cache the others left). Prints one
# table (benchmarks/layout_table.py, output tok/s over BASELINE's) and keeps few files under $OUT: one archive.
#   MODEL=deepseek-v2 EXTRA="--quantization fp8" LAYOUTS="tp4 tp4-dp4 tp4-ep4-kv8 tp4-dp4-ep4-a2a-tbo-kv8" \
#       BASELINE=tp4-ep4-kv8 CONCS="1 64 256 512" bash benchmarks/at_depth.sh
#   MODEL=deepseek-v3 EXTRA="--quantization w4afp8" LAYOUTS="tp4 tp4-dp4 tp4-ep4" ONEBATCH_BS="1 32 128" ...
# Layout names are benchmarks/layouts.py's, plus a `-kv8` suffix for --kv-cache-dtype fp8_e4m3 and `-nextn` for
# NextN speculative decoding (the seeds' 2x4x4 tree). BUDGET_S bounds the whole run. PROFILE_S=1 also profiles a
# second of each level on every rank (serve_sweep.sh: collectives' time per step, and the part exposed).
set -u
OUT=${OUT:-$PWD/at-depth-out}; MODEL=${MODEL:-deepseek-v2}; LAYERS=${LAYERS:-full}; EXTRA=${EXTRA:-"--quantization fp8"}
LAYOUTS=${LAYOUTS:-"tp4 tp4-dp4"}; CONCS=${CONCS-"1 64 256"}; ONEBATCH_BS=${ONEBATCH_BS:-}; WARM=${WARM:-0}
BUDGET_S=${BUDGET_S:-570}; BASELINE=${BASELINE:-}
NEXTN="--speculative-algorithm NEXTN --speculative-num-steps 2 --speculative-eagle-topk 4 --speculative-num-draft-tokens 4"
S=$(mktemp -d); mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
flags_of() {  # $1: a layout name with optional -kv8 / -nextn suffixes -> "<layouts.py name>|<extra flags>"
    local name=$1 extra=$EXTRA
    while :; do
        case $name in
            *-kv8) name=${name%-kv8}; extra="$extra --kv-cache-dtype fp8_e4m3" ;;
            *-nextn) name=${name%-nextn}; extra="$extra $NEXTN" ;;
            *) break ;;
        esac
    done
    echo "$name|$extra"
}
layers=(); [ "$LAYERS" != full ] && layers=(--num-layers "$LAYERS")
for lay in $LAYOUTS; do
    IFS='|' read -r name extra <<< "$(flags_of "$lay")"
    if [ -n "$ONEBATCH_BS" ] && [ "$(left)" -gt 120 ]; then
        read -r -a lf <<< "$(python3 benchmarks/layouts.py "$name")"
        # shellcheck disable=SC2086
        timeout $(( $(left) - 60 )) python3 -m dsctl bench one-batch --model "$MODEL" --load-format dummy "${layers[@]}" \
            "${lf[@]}" $extra --batch-size $ONEBATCH_BS --input-len 1024 --output-len 32 \
            --cuda-graph-bs "${ONEBATCH_BS// /,}" --result-file "$S/onebatch-$lay.jsonl" > "$S/onebatch-$lay.log" 2>&1
        say "one-batch $lay rc=$?"
    fi
    [ "$(left)" -gt 90 ] || { say "no time left for serving $lay"; continue; }
    OUT=$S TAG=$lay MODEL=$MODEL LAYERS=$LAYERS LAYOUT=$name EXTRA="$extra" CONCS="$CONCS" \
        HEALTH_WAIT_S=$(( $(left) - 30 )) timeout $(( $(left) - 5 )) bash benchmarks/serve_sweep.sh > "$S/$lay.txt" 2>&1
    say "serve $lay rc=$? ($(grep -hoE "healthy after [0-9.]+ s|not healthy" "$S/$lay.txt"))"
    pkill -f "dsctl serve" 2>/dev/null
done
if [ "$WARM" = 1 ] && [ "$(left)" -gt 90 ]; then
    first=${LAYOUTS%% *}; IFS='|' read -r name extra <<< "$(flags_of "$first")"
    OUT=$S TAG=$first-warm MODEL=$MODEL LAYERS=$LAYERS LAYOUT=$name EXTRA="$extra" CONCS= \
        HEALTH_WAIT_S=$(( $(left) - 20 )) timeout $(( $(left) - 5 )) bash benchmarks/serve_sweep.sh > "$S/warm.txt" 2>&1
    say "warm start $first: $(grep -hoE "healthy after [0-9.]+ s|not healthy" "$S/warm.txt")"
    grep -h "not healthy" -A30 "$S/warm.txt" | tail -20
fi
tar czf "$OUT/at-depth.tgz" -C "$S" .
for f in "$S"/onebatch-*.jsonl; do
    [ -e "$f" ] && python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f\"{sys.argv[2]:>24} one-batch {r['batch_size']:>4}: {r['median_decode_latency_s'] * 1e3:8.3f} ms, \"
          f\"floor {r.get('decode_floor_ms') or float('nan'):7.3f}, x {r.get('decode_vs_floor') or float('nan'):5.2f}\")
" "$f" "$(basename "$f" .jsonl)"
done
python3 benchmarks/layout_table.py "$S" ${BASELINE:+--baseline "$BASELINE"}
