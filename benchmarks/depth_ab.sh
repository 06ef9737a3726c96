#!/usr/bin/env bash
# A full-depth model on the GPUs of one call: `dsctl bench one-batch` per layout (batch 1 and 128 against the bytes
# floor), `dsctl serve` at concurrency 1 (TPOT against the one-batch step) and its start-up, cold then warm, each
# rank's start-up phases from its log. Issue 35's rows at TP 2 on 2 x H200; MODEL / TP / EXTRA for others.
#   bash benchmarks/depth_ab.sh                          # V2 236B FP8, --tp 2, layouts: tp, tp + DP attention
#   LAYOUTS="tp sep" bash benchmarks/depth_ab.sh         # + --shared-experts-backend separate
#   STAGES="onebatch" TREE=.peer/before bash ...          # another checkout's engine (its one-batch only)
# Keeps few files under $OUT (a lent machine returns a limited number): one log per stage, one JSONL of
# one-batch rows, and prints a table last. BUDGET_S bounds the whole run (each stage gets what is left).
set -u
OUT=${OUT:-$PWD/depth-out}; MODEL=${MODEL:-deepseek-v2}; TP=${TP:-2}; TREE=${TREE:-.}
EXTRA=${EXTRA:-"--quantization fp8"}; LAYOUTS=${LAYOUTS:-"tp dp"}; STAGES=${STAGES:-"onebatch serve"}
BUDGET_S=${BUDGET_S:-570}; PORT=${PORT:-30555}
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
if [[ " $STAGES " == *" onebatch "* ]]; then
    for lay in $LAYOUTS; do
        [ "$(left)" -gt 60 ] || { say "no time left for one-batch $lay"; break; }
        # shellcheck disable=SC2046,SC2086
        timeout "$(left)" bash -c "cd '$TREE' && exec python3 -m dsctl bench one-batch --model $MODEL --load-format dummy \
            $EXTRA $(layout_flags "$lay") --batch-size 1 128 --input-len 256 --output-len 32 --max-running-requests 128 \
            --cuda-graph-bs 1,128 --result-file '$OUT/onebatch-$lay.jsonl'" > "$OUT/onebatch-$lay.log" 2>&1
        say "one-batch $lay rc=$?"
        pkill -f "dsctl bench one-batch" 2>/dev/null; sleep 2
    done
fi

serve_once() {  # $1: tag; starts dsctl serve --tp $TP, waits for /health, optionally runs concurrency 1
    local tag=$1 conc=$2 start pid
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    (cd "$TREE" && exec python3 -m dsctl serve --model "$MODEL" --load-format dummy --port "$PORT" \
        --max-model-len 4096 --tp "$TP" $EXTRA) > "$OUT/serve-$tag.log" 2>&1 &
    pid=$!
    while ! curl -sf "127.0.0.1:$PORT/health" > /dev/null; do
        kill -0 $pid 2>/dev/null && [ "$(left)" -gt 5 ] || { say "serve $tag: not healthy"; kill $pid 2>/dev/null; return 1; }
        sleep 0.5
    done
    say "serve $tag: healthy after $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
    if [ "$conc" = 1 ]; then
        timeout "$(left)" python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts 8 \
            --max-concurrency 1 --random-input-len 1024 --random-output-len 256 \
            --result-file "$OUT/serve-c1.jsonl" > "$OUT/serve-c1.txt" 2>&1
        say "serving at concurrency 1 rc=$?"
    fi
    kill -TERM $pid; wait $pid 2>/dev/null
    pkill -f "dsctl serve" 2>/dev/null; sleep 2
}
if [[ " $STAGES " == *" serve "* ]]; then
    serve_once first 1  # the first start on this machine (cold Triton cache unless one was carried)
    [ "$(left)" -gt 60 ] && serve_once again 0  # warm
fi

for f in "$OUT"/serve-first.log "$OUT"/serve-again.log; do
    [ -f "$f" ] && { echo "== $(basename "$f")"; grep -hE "rank 0: weights|CUDA graphs:|piecewise CUDA|Error|error:" "$f" | cut -c1-300 | head -5; }
done
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
c1 = os.path.join(out, "serve-c1.jsonl")
for line in open(c1) if os.path.exists(c1) else []:
    r = json.loads(line)
    print(f"serve concurrency 1: {r['completed']} ok / {r['failed']} failed, TPOT p50 {r['tpot_ms']['median']:.2f} ms, "
          f"ITL p50 {r['itl_ms']['median']:.2f} / p99 {r['itl_ms']['p99']:.2f} ms, TTFT p50 {r['ttft_ms']['median']:.1f} ms")
PY
