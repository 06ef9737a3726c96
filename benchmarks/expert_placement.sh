#!/usr/bin/env bash
# Routing counts and expert placement on the GPUs of one call (issue 37, item 4): the recording's cost in the
# one-batch step (same layout with and without --record-expert-load), then dsctl serve with the counts recorded
# under load, dsctl place-experts from its GET /expert_load, and dsctl serve again with the placement; each server
# at concurrency 64 and 256 (exact 1024 in / 256 out). Prints a table last.
#   bash benchmarks/expert_placement.sh                        # V3 shapes, 5 layers, 2 GPUs: DP attention + EP a2a
#   MODEL=deepseek-v2 LAYERS=full TP=2 REDUNDANT=8 LAYOUT="--tp 2 --ep 2" bash benchmarks/expert_placement.sh
set -u
OUT=${OUT:-$PWD/placement-out}; MODEL=${MODEL:-deepseek-v3}; LAYERS=${LAYERS:-5}; TP=${TP:-2}
LAYOUT=${LAYOUT:-"--tp $TP --enable-dp-attention --dp $TP --ep $TP --moe-a2a-backend torch"}
REDUNDANT=${REDUNDANT:-16}; PORT=${PORT:-30555}; CONCS=${CONCS:-"64 256"}
mkdir -p "$OUT"
T0=$(date +%s); say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
layers=(); [ "$LAYERS" != full ] && layers=(--num-layers "$LAYERS")
M=(--model "$MODEL" --load-format dummy "${layers[@]}")
for v in plain rec; do
    x=""; [ $v = rec ] && x="--record-expert-load"
    # shellcheck disable=SC2086
    timeout 300 python3 -m dsctl bench one-batch "${M[@]}" $LAYOUT $x --batch-size 1 128 --input-len 256 \
        --output-len 32 --max-running-requests 128 --cuda-graph-bs 1,128 --result-file "$OUT/ob-$v.jsonl" \
        > "$OUT/ob-$v.log" 2>&1
    say "one-batch $v rc=$?"; pkill -f "dsctl bench"; sleep 2
done
serve() {  # $1: tag; the rest: extra serve flags
    local tag=$1; shift
    # shellcheck disable=SC2086
    python3 -m dsctl serve "${M[@]}" $LAYOUT --port "$PORT" --max-model-len 4096 "$@" > "$OUT/serve-$tag.log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; kill -0 $pid || break; sleep 0.5; done
    say "serve $tag healthy: $(curl -sf "127.0.0.1:$PORT/health" >/dev/null && echo yes || echo NO)"
    for c in $CONCS; do
        python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts $(( c < 128 ? 2 * c : c )) \
            --max-concurrency "$c" --random-input-len 1024 --random-output-len 256 --result-file "$OUT/bench-$tag.jsonl" \
            > "$OUT/bench-$tag-c$c.txt" 2>&1
        say "bench $tag c=$c rc=$?"
    done
    curl -sf "127.0.0.1:$PORT/expert_load" > "$OUT/load-$tag.json"
    curl -sf "127.0.0.1:$PORT/metrics" | grep -E "^dsctl_expert_load"
    kill -TERM $pid; wait $pid; say "serve $tag exit $?"
}
serve rec --record-expert-load
python3 -m dsctl place-experts --load "$OUT/load-rec.json" --ep "$TP" --redundant "$REDUNDANT" -o "$OUT/placement.json" \
    > "$OUT/place.txt" 2>&1 || cat "$OUT/place.txt"
serve placed --record-expert-load --expert-placement "$OUT/placement.json"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = lambda p: [json.loads(l) for l in open(p)] if os.path.exists(p) else []
for v in ("plain", "rec"):
    for r in rows(f"{out}/ob-{v}.jsonl"):
        print(f"one-batch {v:6} batch {r['batch_size']:4}: {r['median_decode_latency_s'] * 1e3:8.3f} ms, "
              f"{r.get('decode_vs_floor') or float('nan'):.2f}x the floor")
for tag in ("rec", "placed"):
    for r in rows(f"{out}/bench-{tag}.jsonl"):
        print(f"serve {tag:6} conc {r['flags']['max_concurrency']:4}: {r['completed']} ok / {r['failed']} failed, "
              f"{r['output_throughput']:8.1f} out tok/s, TPOT p50 {r['tpot_ms']['median']:.2f} ms")
    p = f"{out}/load-{tag}.json"
    if os.path.exists(p) and os.path.getsize(p):
        layers = json.load(open(p))["layers"].values()
        ratios = [max(v["ranks"]) * len(v["ranks"]) / sum(v["ranks"]) for v in layers if sum(v["ranks"])]
        print(f"serve {tag:6} EP rank imbalance (busiest / mean, mean over layers): {sum(ratios) / max(1, len(ratios)):.4f}")
PY
