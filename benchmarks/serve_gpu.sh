#!/usr/bin/env bash
# dsctl serve on one GPU with DeepSeek-V3 shapes (dummy FP8 weights, N layers), measured with dsctl bench serving,
# once with overlap scheduling (default) and once with --disable-overlap-schedule. Writes $OUT/serve-*.log, bench.jsonl.
#   OUT=/tmp/o LAYERS=5 PROMPTS=64 bash benchmarks/serve_gpu.sh
set -u
OUT=${OUT:-$PWD/serve-out}; LAYERS=${LAYERS:-5}; PROMPTS=${PROMPTS:-64}; PORT=${PORT:-30555}
mkdir -p "$OUT"
python3 -c "import uvicorn, starlette, prometheus_client, pydantic, httpx" || {
    echo "the server needs uvicorn, starlette, prometheus_client, pydantic, httpx: pip install them (or carry wheels)"; exit 2; }
for mode in overlap no-overlap; do
    extra=(); [ "$mode" = no-overlap ] && extra=(--disable-overlap-schedule)
    python3 -m dsctl serve --model deepseek-v3 --load-format dummy --num-layers "$LAYERS" --port "$PORT" \
        --max-model-len 4096 "${extra[@]}" > "$OUT/serve-$mode.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do
        curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || break  # the server died: stop waiting
        sleep 1
    done
    curl -sf "127.0.0.1:$PORT/health" || { echo "$mode: server not healthy"; tail -20 "$OUT/serve-$mode.log"; kill $pid; continue; }
    echo; echo "== $mode"
    python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts "$PROMPTS" \
        --random-input-len 256 --random-output-len 128 --max-concurrency 32 --result-file "$OUT/bench-$mode.jsonl" 2>&1 | tail -22
    kill -TERM $pid; wait $pid; echo "$mode server exit $?"
done
