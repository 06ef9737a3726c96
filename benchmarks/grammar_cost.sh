#!/usr/bin/env bash
# Grammar-constrained decoding on one GPU (issue 38): V3 shapes, 5 layers, dummy FP8 weights, CUDA graphs on.
#   1. TPOT of json_schema-constrained chat requests against the same requests unconstrained, same server,
#      concurrency 64 (benchmarks/grammar_cost.py; target: at most +5%), and the constrained outputs valid.
#   2. The same model with NextN speculative decoding on: constrained outputs valid (grammar batches decode
#      without speculation), and an unconstrained round next to them still completes.
# About 4-5 minutes on one H100 (two server start-ups of ~40-60 s each). Logs and results under $OUT.
#   bash benchmarks/grammar_cost.sh
set -u
OUT=${OUT:-$PWD/grammar-out}; PORT=${PORT:-30555}; CONC=${CONC:-64}; REQS=${REQS:-128}; TOKENS=${TOKENS:-256}
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

start_server() {  # $1: tag, rest: extra flags
    local tag=$1; shift
    python3 -m dsctl serve --model deepseek-v3 --load-format dummy --num-layers 5 --port "$PORT" \
        --max-model-len 4096 "$@" > "$OUT/$tag-serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 400); do
        curl -sf "$URL/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.5
    done
    curl -sf "$URL/health" >/dev/null || { echo "$tag: server not healthy"; tail -30 "$OUT/$tag-serve.log"; kill $pid; exit 1; }
    echo "$tag: server healthy"
}

stop_server() { kill -TERM $pid; wait $pid; }

start_server graphs
timeout 240 python3 benchmarks/grammar_cost.py --url "$URL" --concurrency "$CONC" --requests "$REQS" \
    --max-tokens "$TOKENS" --rounds 2 2>&1 | tee "$OUT/graphs.txt"
rc1=${PIPESTATUS[0]}
grep -E "graph|captured" "$OUT/graphs-serve.log" | head -3
stop_server

[ "${NEXTN:-1}" = 0 ] && { echo "exit code: graphs=$rc1"; exit "$rc1"; }
start_server nextn --speculative-algorithm NEXTN
timeout 120 python3 benchmarks/grammar_cost.py --url "$URL" --check-only 2>&1 | tee "$OUT/nextn.txt"
rc2=${PIPESTATUS[0]}
timeout 120 python3 benchmarks/grammar_cost.py --url "$URL" --concurrency 16 --requests 16 --max-tokens 64 \
    --rounds 1 2>&1 | tee -a "$OUT/nextn.txt"
rc3=${PIPESTATUS[0]}
curl -sf "$URL/metrics" | grep -E "^dsctl_spec_(plain_steps|accept)" | head -4
stop_server
echo "exit codes: graphs=$rc1 nextn_check=$rc2 nextn_mixed=$rc3 (0 = every request ok and every constrained output valid)"
