#!/usr/bin/env bash
# `dsctl bench one-batch` of this checkout against another one (BEFORE, e.g. an older commit unpacked into
# the ignored .peer/ folder), interleaved BEFORE / AFTER for ROUNDS rounds in one run on one GPU; prints the
# median decode step of each side per batch size and their ratio. Default: V3 shapes, 5 layers, dummy FP8.
#   git archive 6349192 | (mkdir -p .peer/before && tar -x -C .peer/before)
#   BEFORE=.peer/before BATCHES="1 128" bash benchmarks/one_batch_ab.sh
set -u
OUT=${OUT:-$PWD/one-batch-ab}; BEFORE=${BEFORE:?set BEFORE to the other checkout}
BATCHES=${BATCHES:-1 128}; LAYERS=${LAYERS:-5}; ROUNDS=${ROUNDS:-2}; MODEL=${MODEL:-deepseek-v3}
INLEN=${INLEN:-256}; OUTLEN=${OUTLEN:-32}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
here=$PWD
for round in $(seq "$ROUNDS"); do
    for side in before after; do
        tree=$here; [ $side = before ] && tree=$BEFORE
        # shellcheck disable=SC2086
        (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -m dsctl bench one-batch --model "$MODEL" --load-format dummy \
            --num-layers "$LAYERS" --batch-size $BATCHES --input-len "$INLEN" --output-len "$OUTLEN" \
            --max-running-requests 128 $EXTRA --result-file "$OUT/$side.jsonl") > "$OUT/$side-$round.log" 2>&1 \
            || { echo "$side round $round failed"; tail -20 "$OUT/$side-$round.log"; }
    done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys, os
rows = {}
for side in ("before", "after"):
    path = os.path.join(sys.argv[1], f"{side}.jsonl")
    for line in open(path) if os.path.exists(path) else []:
        r = json.loads(line)
        rows.setdefault(r["batch_size"], {}).setdefault(side, []).append(r["median_decode_latency_s"] * 1e3)
print(f"\n{'batch':>5} {'before ms (runs)':>22} {'after ms (runs)':>22} {'after/before':>12}")
for bs, d in sorted(rows.items()):
    b, a = d.get("before", []), d.get("after", [])
    ratio = statistics.median(a) / statistics.median(b) if a and b else float("nan")
    fmt = lambda v: ",".join(f"{x:.3f}" for x in v)
    print(f"{bs:>5} {fmt(b):>22} {fmt(a):>22} {ratio:12.3f}")
PY
