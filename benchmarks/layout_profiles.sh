#!/usr/bin/env bash
# Where each layout's decode step goes, at depth on the GPUs of one call (issues 35 and 37: "a per-kernel profile of
# what remains"): per layout, `dsctl bench one-batch --profile` at BATCHES (decode step against its bytes floor),
# then benchmarks/decode_kernels.py on rank 0's trace of each batch size (kernel time by family and by kernel, busy
# against span). Keeps only text under $OUT (the traces stay in a temporary folder) and prints the tables last.
#   MODEL=deepseek-v2 EXTRA="--quantization fp8 --mem-fraction-static 0.93" LAYOUTS="tp2 tp2-ep2 tp2-dp2-ep2" \
#       bash benchmarks/layout_profiles.sh
#   MODEL=deepseek-v3 LAYERS=5 LAYOUTS="tp1" BATCHES="1 32 128" ...
# Layout names are benchmarks/layouts.py's. BUDGET_S bounds the whole run.
set -u
OUT=${OUT:-$PWD/profiles-out}; MODEL=${MODEL:-deepseek-v2}; LAYERS=${LAYERS:-full}; LAYOUTS=${LAYOUTS:-"tp2 tp2-dp2"}
EXTRA=${EXTRA:-"--quantization fp8"}; BATCHES=${BATCHES:-"1 128"}; INPUT=${INPUT:-256}; OUTPUT=${OUTPUT:-16}
BUDGET_S=${BUDGET_S:-570}
S=$(mktemp -d); mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
layers=(); [ "$LAYERS" != full ] && layers=(--num-layers "$LAYERS")
depth=$LAYERS
[ "$LAYERS" = full ] && depth=$(python3 -c "
from engine.checkpoint.config import parse_config
from engine.checkpoint.registry import lookup
print(parse_config(lookup('$MODEL').config_dict()).num_hidden_layers)")
for lay in $LAYOUTS; do
    [ "$(left)" -gt 90 ] || { echo "no time left for $lay"; break; }
    read -r -a lf <<< "$(python3 benchmarks/layouts.py "$lay")"
    # shellcheck disable=SC2086
    timeout $(( $(left) - 20 )) python3 -m dsctl bench one-batch --model "$MODEL" --load-format dummy "${layers[@]}" \
        "${lf[@]}" $EXTRA --batch-size $BATCHES --input-len "$INPUT" --output-len "$OUTPUT" \
        --max-running-requests "${BATCHES##* }" --cuda-graph-bs "${BATCHES// /,}" --result-file "$OUT/$lay.jsonl" \
        --profile "$S/$lay.json" > "$OUT/$lay.log" 2>&1
    echo "[$(( $(date +%s) - T0 )) s] $lay rc=$?"
    pkill -f "dsctl bench one-batch" 2>/dev/null; sleep 2
    for bs in $BATCHES; do
        trace=$(ls "$S/$lay"-rank0-bs"$bs"-*.json "$S/$lay"-bs"$bs"-*.json 2>/dev/null | head -1)
        [ -n "$trace" ] && python3 benchmarks/decode_kernels.py "$trace" --num-layers "$depth" > "$OUT/$lay-bs$bs.txt" 2>&1
    done
done
rm -rf "$S"
for lay in $LAYOUTS; do
    [ -e "$OUT/$lay.jsonl" ] && python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f\"{sys.argv[2]:>16} batch {r['batch_size']:>4}: {r['median_decode_latency_s'] * 1e3:8.3f} ms, \"
          f\"floor {r.get('decode_floor_ms') or float('nan'):7.3f}, x {r.get('decode_vs_floor') or float('nan'):5.2f}\")
" "$OUT/$lay.jsonl" "$lay"
    for bs in $BATCHES; do [ -e "$OUT/$lay-bs$bs.txt" ] && head -14 "$OUT/$lay-bs$bs.txt"; done
done
