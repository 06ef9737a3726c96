#!/usr/bin/env bash
# Kernels per decode step and per layer (benchmarks/profile_decode_kernels.py: a MoE layer from 5 -> 6 layers,
# a dense layer from 2 -> 3) of another checkout (BEFORE, e.g. the last commit unpacked into .peer/before) and
# of this one, then `dsctl bench one-batch` of both, interleaved (benchmarks/one_batch_ab.sh), with the bytes
# floor of this checkout's batch-1 step. Default: V3 shapes, dummy FP8, batch 1, one GPU. Issue 35, item 2.
#   git archive HEAD | (mkdir -p .peer/before && tar -x -C .peer/before)
#   BEFORE=.peer/before bash benchmarks/launches_ab.sh
set -u
OUT=${OUT:-$PWD/launches-ab}; BEFORE=${BEFORE:?set BEFORE to the other checkout}
MODEL=${MODEL:-deepseek-v3}; BATCH=${BATCH:-1}
mkdir -p "$OUT"
here=$PWD
for side in before after; do
    tree=$here; [ $side = before ] && tree=$(cd "$BEFORE" && pwd)
    for layers in 5 2; do
        python3 "$here/benchmarks/profile_decode_kernels.py" --tree "$tree" --model "$MODEL" --num-layers $layers \
            --batch-size "$BATCH" --layer-delta > "$OUT/kernels-$side-$layers.txt" 2>&1 \
            || { echo "$side $layers layers failed"; tail -20 "$OUT/kernels-$side-$layers.txt"; }
    done
done
echo "kernels per decode step (whole step / per layer), and one layer alone:"
for side in before after; do
    for layers in 5 2; do
        f="$OUT/kernels-$side-$layers.txt"
        echo "  $side: $(grep -m1 'kernels per decode step' "$f" | cut -c1-100)"
        echo "  $side: $(grep 'alone' "$f" | cut -c1-100)"
    done
done
OUT="$OUT/one-batch" BEFORE="$BEFORE" BATCHES="$BATCH" MODEL="$MODEL" bash "$here/benchmarks/one_batch_ab.sh"
echo "bytes floor (this checkout's runs; the table's floor and x floor columns):"
grep -h -A4 "floor" "$OUT"/one-batch/after-1.log | head -20
