#!/usr/bin/env bash
# The server's request limits off vs on (issue 39), same GPU, same load: DeepSeek-V3 shapes (dummy weights,
# block FP8 as V3 ships, LAYERS layers) under dsctl bench serving at concurrency CONC with random prompts of
# exactly IN tokens and exactly OUTLEN output tokens. Each mode gets its own server and ROUNDS runs (seeds
# 1..ROUNDS, the same in both modes, so neither mode gets prefix-cache hits the other does not); the table
# compares the best output tok/s of each.
# "off" sets every limit flag to 0 (no limit); "on" is the defaults. Prints both and on / off (acceptance: >= 0.97).
# About 5 minutes on one H100 with the defaults. Writes $OUT/limits-{off,on}-serve.log and .jsonl.
#   bash benchmarks/limits_ab.sh
#   OUT=/tmp/o CONC=256 IN=1024 OUTLEN=256 ROUNDS=2 bash benchmarks/limits_ab.sh
set -u
OUT=${OUT:-$PWD/limits-out}; LAYERS=${LAYERS:-5}; CONC=${CONC:-256}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-256}
ROUNDS=${ROUNDS:-2}; PROMPTS=${PROMPTS:-$((2 * CONC))}; PORT=${PORT:-30556}
mkdir -p "$OUT"
rm -f "$OUT/limits-off.jsonl" "$OUT/limits-on.jsonl"
OFF=(--max-body-bytes 0 --max-json-depth 0 --max-sequences-per-request 0 --max-request-prompt-tokens 0
     --max-queued-requests 0)
for mode in off on; do
    extra=(); [ "$mode" = off ] && extra=("${OFF[@]}")
    python3 -m dsctl serve --model deepseek-v3 --load-format dummy --num-layers "$LAYERS" \
        --port "$PORT" --max-model-len 4096 "${extra[@]}" > "$OUT/limits-$mode-serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 400); do
        curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.5
    done
    curl -sf "127.0.0.1:$PORT/health" >/dev/null || {
        echo "limits $mode: server not healthy"; tail -30 "$OUT/limits-$mode-serve.log"; kill $pid; exit 1; }
    for seed in $(seq "$ROUNDS"); do
        python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts "$PROMPTS" \
            --max-concurrency "$CONC" --random-input-len "$IN" --random-output-len "$OUTLEN" --seed "$seed" \
            --result-file "$OUT/limits-$mode.jsonl" > "$OUT/limits-$mode-$seed.txt" 2>&1 \
            || { echo "limits $mode seed $seed: bench failed"; tail -20 "$OUT/limits-$mode-$seed.txt"; }
        grep -E "output token throughput|failed|completed" "$OUT/limits-$mode-$seed.txt" | sed "s/^/$mode seed $seed: /"
    done
    t=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?
    echo "limits $mode: server exit $rc, $(python3 -c "import time; print(f'{time.time() - $t:.1f}')") s after SIGTERM"
done
python3 - "$OUT" <<'PY'
import json, sys
best = {}
for mode in ("off", "on"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/limits-{mode}.jsonl")]
    best[mode] = max(r["output_throughput"] for r in rows)
    print(f"limits {mode}: output tok/s per run {[round(r['output_throughput'], 1) for r in rows]}, "
          f"best {best[mode]:.1f}")
print(f"on / off = {best['on'] / best['off']:.4f} (acceptance: >= 0.97)")
PY
