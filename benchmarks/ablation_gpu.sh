#!/usr/bin/env bash
# `dsctl bench ablation` on one GPU: DeepSeek-V3 shapes, dummy FP8 weights, 5 layers (issue 18's table for
# docs/perf.md, beside the seed's). Every row of dsctl/ablation_grid.py runs `dsctl bench offline` in its own
# process: baseline (MLA, CUDA graph, radix cache), -MLA (--disable-mla), +torch.compile, -CUDA graph,
# -radix cache, +FlashInfer MLA (❌ when flashinfer is not installed), the seed's combinations; EP-MoE and
# DP attention rows are ❌ at --tp 1 (nothing to split on one GPU).
# Sized for < 8 minutes on one H100: short lengths, two CUDA-graph sizes (fewer torch.compile shapes),
# a time budget for the grid (rows not started by then are ❌ and the table is still printed) and a
# per-row timeout. Writes $DIR/ablation.jsonl, $DIR/ablation.png (if matplotlib), $DIR/logs/row-NN.log
# (DIR default /tmp/ablation); when $OUT names a folder (the lent machine's return folder), it also gets
# ablation.jsonl, ablation.png, table.txt and logs.tar.gz (4 files).
#   bash benchmarks/ablation_gpu.sh
# The lent GPU image has torch/triton but not typer/rich: carry them as pure-Python packages in .whl/site
# (git-ignored), e.g. `mkdir -p .whl/site; cp -r <venv site-packages>/{typer,click,rich,markdown_it,mdurl,\
# shellingham,typing_extensions.py} .whl/site/`; this script puts .whl/site on PYTHONPATH when it exists.
set -u
[ -d .whl/site ] && export PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
DIR=${DIR:-/tmp/ablation}; LAYERS=${LAYERS:-5}; BUDGET=${BUDGET:-420}; ROW_TIMEOUT=${ROW_TIMEOUT:-180}
mkdir -p "$DIR"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$DIR/inductor-cache}
python3 -c "import torch, triton, typer, rich; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || {
    echo "needs torch with CUDA, triton, typer and rich"; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the outer timeout is a last resort only: --time-budget ends the grid first and still prints the table
COLUMNS=${COLUMNS:-160} timeout $((BUDGET + 60)) python3 -m dsctl bench ablation \
    --model deepseek-v3 --load-format dummy --num-layers "$LAYERS" --max-model-len 1024 \
    --cuda-graph-bs 1,16 --max-running-requests 16 \
    --input-len 256 --output-len 32 --concurrency 16 \
    --row-timeout "$ROW_TIMEOUT" --time-budget "$BUDGET" --out-dir "$DIR" 2>&1 | tee "$DIR/table.txt"
rc=${PIPESTATUS[0]}
echo "bench ablation exit $rc"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$OUT" != "$DIR" ]; then
    cp "$DIR"/ablation.jsonl "$DIR"/ablation.png "$DIR"/table.txt "$OUT"/ 2>/dev/null
    tar -czf "$OUT/logs.tar.gz" -C "$DIR" logs
fi
exit $rc
