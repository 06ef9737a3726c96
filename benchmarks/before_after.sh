#!/usr/bin/env bash
# The decode step of this checkout against another one (BEFORE, e.g. an older commit unpacked into
# the ignored .peer/ folder), interleaved in one run on one GPU: bench_decode.py from each tree,
# BEFORE / AFTER / BEFORE / AFTER, CUDA graphs, bf16 KV, Triton attention, V3 shapes (dummy FP8).
#   git archive dfbcc6a | (mkdir -p .peer/before && tar -x -C .peer/before)
#   BEFORE=.peer/before SIZES=1,128 bash benchmarks/before_after.sh
set -eu
OUT=${OUT:-$PWD/before-after}; BEFORE=${BEFORE:?set BEFORE to the other checkout}; SIZES=${SIZES:-1,128}
LAYERS=${LAYERS:-5}; MODES=${MODES:-graph}
mkdir -p "$OUT"
for round in 1 2; do
    for side in before after; do
        tree=.; [ $side = before ] && tree=$BEFORE
        dir="$OUT/$side-$round"; mkdir -p "$dir"
        (cd "$tree" && python3 benchmarks/bench_decode.py --num-layers "$LAYERS" --batch-sizes "$SIZES" \
            --modes "$MODES" --kv-dtypes auto --no-per-layer --out "$dir") > "$dir/log.txt" 2>&1 \
            || { echo "$side round $round failed"; tail -20 "$dir/log.txt"; }
    done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys, glob, os
rows = {}
for path in glob.glob(os.path.join(sys.argv[1], "*", "bench_decode.json")):
    side = os.path.basename(os.path.dirname(path)).split("-")[0]
    data = json.load(open(path))
    for r in data["rows"]:
        if "bs" in r:
            rows.setdefault((r["mode"], r["bs"]), {}).setdefault(side, []).append(r["decode_ms"])
print(f"\nGPU: {data['gpu']}  decode step ms (each side: every run)")
print(f"{'mode':6} {'bs':>4} {'before':>16} {'after':>16} {'after/before':>12}")
for (mode, bs), d in sorted(rows.items()):
    b, a = d.get("before", []), d.get("after", [])
    ratio = statistics.median(a) / statistics.median(b) if a and b else float("nan")
    fmt = lambda v: ",".join(f"{x:.3f}" for x in v)
    print(f"{mode:6} {bs:>4} {fmt(b):>16} {fmt(a):>16} {ratio:12.3f}")
PY
