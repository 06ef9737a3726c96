#!/usr/bin/env bash
# The multi-GPU runs of one node (issue 19 on 2 GPUs), by stage; each stage prints a short table.
#   STAGES="topo collectives check" bash benchmarks/multi_gpu.sh
#   STAGES="onebatch serve" LAYOUTS="tp1 tp2 tp2-dp2 tp2-ep2" bash benchmarks/multi_gpu.sh
# Stages:
#   topo         GPUs, their links (nvidia-smi topo -m) and the NCCL variables in force
#   collectives  all-reduce / all-gather at hidden 7168, T = 1..4096, vs the link's bus bandwidth
#   check        V2-Lite (27 layers, dummy bf16): greedy tokens of every layout vs tp1, CUDA graphs off and on
#   fp32         the same in float32 (tf32 dots): log-probs agree closely, so tokens should match tp1's
#   compile      CUDA graphs + torch.compile, every layout vs tp1 eager, at COMPILE_LAYERS layers (compile time grows with depth)
#   compile4     the same rows (tp1 tp2 tp2-dp2 tp2-ep2) on a 4-GPU host, two pairs of GPUs at once; COMPILE_MRR=N caps
#                the running requests so every decode step replays a compiled graph size; COMPILE_DTYPE=float32
#                with TIE_GAP=0.02 for the close check (bf16 at 27 layers diverges at gaps up to ~0.1 in any layout)
#   v3fit        DeepSeek-V3 dummy FP8 at the deepest truncation every tp>1 layout holds: runs, tokens vs tp2
#   v3control    the control for v3fit: tp2 against itself run one request at a time (another batch composition),
#                at V3_LAYERS layers (default: fit), so FP8 rounding noise can be told from a wrong shard
#   onebatch     dsctl bench one-batch, V3 5 layers dummy FP8, batch 1 / 32 / 128, per layout, vs the bytes floor
#   serve        dsctl serve + dsctl bench serving (exact 1024 in / 256 out) at CONCS, per layout
#   spec         dsctl bench offline per layout, speculation off and on (SPEC_TREE steps,topk,nodes; default
#                2,1,3): the batch-1 step (tokens per step / tok/s; dummy weights accept nothing) and
#                SPEC_CONC (32) concurrent requests' output tok/s; SPEC_FLAGS: more bench offline options;
#                SPEC_MODEL (deepseek-v3) for a dry run
# Logs and JSONL land in $OUT (default ./multi-gpu-out); the stage tables go to stdout.
# Eight GPUs, full depth (issue 20):
#   NGPU=8 LAYOUTS="tp8 tp8-dp8 tp8-ep8" LAYERS=full ONEBATCH_BS="1 8 32 128" STAGES="topo collectives onebatch" \
#       STAGE_TIMEOUT=900 bash benchmarks/multi_gpu.sh
#   NGPU=8 LAYOUTS="tp8 tp8-dp8" LAYERS=full IN=1000 OUTLEN=1000 CONCS="1 64 256 1024" STAGES=serve bash benchmarks/multi_gpu.sh
#   NGPU=8 LAYOUTS="tp8 tp8-dp8" LAYERS=full IN=1000 OUTLEN=256 STAGES=spec STAGE_TIMEOUT=900 bash benchmarks/multi_gpu.sh
# The GPU image lacks the server's packages: `SITE=.whl/site TARGET_PY=3.12 bash benchmarks/mixed_itl.sh --bundle`
# here, carry .whl/site; this script puts it on PYTHONPATH when it exists.
set -u
[ -d .whl/site ] && export PYTHONPATH="$PWD/.whl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/multi-gpu-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"topo collectives check fp32 compile v3fit onebatch serve"}
LAYOUTS=${LAYOUTS:-"tp1 tp2 tp2-dp2 tp2-ep2"}
NGPU=${NGPU:-2}; CONCS=${CONCS:-"1 64 256"}; COMPILE_LAYERS=${COMPILE_LAYERS:-2}
LAYERS=${LAYERS:-5}  # V3 depth of the onebatch and serve stages ("full": all 61 + the MTP layer)
ONEBATCH_BS=${ONEBATCH_BS:-"1 32 128"}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-256}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}  # seconds per onebatch run / per serve layout (full depth starts slower)
COMPILE_MAX_BS=${COMPILE_MAX_BS:-16}  # graph sizes compiled (1,4,16 captured); each costs its own compile
export PYTHONUNBUFFERED=1
comma() { echo "$*" | tr ' ' ','; }
parallel_layouts() { for l in $LAYOUTS; do [ "$l" != tp1 ] && echo -n "$l "; done; }

stage_topo() {
    nvidia-smi -L; nvidia-smi topo -m
    env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)' | sort
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
}

stage_collectives() {
    python3 benchmarks/bench_collectives.py --tp "$NGPU" --result-file "$OUT/collectives.jsonl"
}

stage_check() {
    python3 benchmarks/multi_gpu_check.py --model deepseek-v2-lite --layouts "$(comma $LAYOUTS)" --modes eager,graph \
        --result-file "$OUT/check-v2lite.jsonl" 2> "$OUT/check-v2lite.log"
}

stage_fp32() {
    python3 benchmarks/multi_gpu_check.py --model deepseek-v2-lite --dtype float32 --layouts "$(comma $LAYOUTS)" \
        --modes eager,graph --tie-gap 0.02 --result-file "$OUT/check-fp32.jsonl" 2> "$OUT/check-fp32.log"
}

stage_compile() {  # reference: tp1 eager; then every layout with graphs + compile (eager rows are in `check`)
    local f="$OUT/check-compile.jsonl" common=(--model deepseek-v2-lite --num-layers "$COMPILE_LAYERS" --result-file)
    rm -f "$f"
    python3 benchmarks/multi_gpu_check.py "${common[@]}" "$f" --layouts tp1 --modes eager 2> "$OUT/check-compile.log" &&
    python3 benchmarks/multi_gpu_check.py "${common[@]}" "$f" --layouts "$(comma $LAYOUTS)" --modes graph+compile \
        --compile-max-bs "$COMPILE_MAX_BS" 2>> "$OUT/check-compile.log" > /dev/null
    python3 benchmarks/multi_gpu_check.py --from-jsonl "$f"
}

stage_compile4() {  # `compile` on a 4-GPU host: two chains of runs on GPUs 0,1 and 2,3 at once (same rows, half the wall)
    local d="$OUT/compile4" mrr=() c=(--model deepseek-v2-lite --num-layers "$COMPILE_LAYERS" --compile-max-bs "$COMPILE_MAX_BS")
    [ -n "${COMPILE_MRR:-}" ] && mrr=(--engine-flag "max_running_requests=$COMPILE_MRR")  # keep decode batches compiled
    [ -n "${COMPILE_DTYPE:-}" ] && c+=(--dtype "$COMPILE_DTYPE")  # float32: rounding small enough to expect tp1's tokens
    mkdir -p "$d"; rm -f "$d"/*.jsonl
    run() { local gpus=$1 name=$2; shift 2
            CUDA_VISIBLE_DEVICES=$gpus python3 benchmarks/multi_gpu_check.py "${c[@]}" "${mrr[@]}" "$@" \
                --result-file "$d/$name.jsonl" > /dev/null 2> "$d/$name.log" || echo "compile4 $name failed: $(tail -1 "$d/$name.log")"; }
    { { run 0 ref --layouts tp1 --modes eager & run 1 tp1 --layouts tp1 --modes graph+compile & wait; }
      run 0,1 dp2 --layouts tp2-dp2 --modes graph+compile; } &
    { run 2,3 tp2 --layouts tp2 --modes graph+compile; run 2,3 ep2 --layouts tp2-ep2 --modes graph+compile; } &
    wait
    cat "$d"/ref.jsonl "$d"/tp1.jsonl "$d"/tp2.jsonl "$d"/dp2.jsonl "$d"/ep2.jsonl 2>/dev/null > "$OUT/check-compile.jsonl"
    python3 benchmarks/multi_gpu_check.py --from-jsonl "$OUT/check-compile.jsonl" --tie-gap "${TIE_GAP:-0.05}"
}

stage_v3fit() {
    python3 benchmarks/multi_gpu_check.py --model deepseek-v3 --num-layers fit --layouts "$(comma $(parallel_layouts))" \
        --modes graph --prompts 8 --max-new-tokens 16 --result-file "$OUT/check-v3fit.jsonl" 2> "$OUT/check-v3fit.log"
}

stage_v3control() {
    local f="$OUT/check-v3control.jsonl"
    local common=(--model deepseek-v3 --num-layers "${V3_LAYERS:-fit}" --layouts tp2 --modes graph --prompts 8
                  --max-new-tokens 16 --result-file "$f")
    rm -f "$f"
    python3 benchmarks/multi_gpu_check.py "${common[@]}" 2> "$OUT/check-v3control.log" > /dev/null &&
    python3 benchmarks/multi_gpu_check.py "${common[@]}" --engine-flag max_running_requests=1 --tag one-at-a-time \
        2>> "$OUT/check-v3control.log" > /dev/null
    python3 benchmarks/multi_gpu_check.py --from-jsonl "$f"
}

stage_onebatch() {
    local bw
    bw=$(python3 -c "import sys; sys.path.insert(0, '.'); from engine.distributed.step_floor import copy_bandwidth; print(copy_bandwidth())")
    for l in $LAYOUTS; do
        read -r -a lf <<< "$(python3 benchmarks/layouts.py "$l")"
        local depth=(); [ "$LAYERS" != full ] && depth=(--num-layers "$LAYERS")
        # shellcheck disable=SC2086
        timeout "$STAGE_TIMEOUT" python3 -m dsctl bench one-batch --model deepseek-v3 --load-format dummy "${depth[@]}" \
            --batch-size $ONEBATCH_BS --input-len 512 --output-len 32 --cuda-graph-bs "$(comma $ONEBATCH_BS)" "${lf[@]}" \
            --result-file "$OUT/onebatch.jsonl" > "$OUT/onebatch-$l.log" 2>&1 || { echo "onebatch $l failed:"; tail -5 "$OUT/onebatch-$l.log"; }
    done
    python3 benchmarks/multi_gpu_tables.py onebatch "$OUT/onebatch.jsonl" "$bw"
}

stage_serve() {
    for l in $LAYOUTS; do
        TAG="v3-$l" LAYOUT="$l" CONCS="$CONCS" OUT="$OUT" PORT=30555 LAYERS="$LAYERS" IN="$IN" OUTLEN="$OUTLEN" \
            EXTRA="--cuda-graph-bs 1,2,4,8,16,32,48,64,96,128,192,256" \
            timeout "$STAGE_TIMEOUT" bash benchmarks/serve_sweep.sh > "$OUT/serve-$l.txt" 2>&1 || echo "serve $l: exit $?"
        grep -E "^v3-$l c=|healthy|not healthy|server exit|outlived" "$OUT/serve-$l.txt"
    done
    python3 benchmarks/multi_gpu_tables.py serve "$OUT" $LAYOUTS
}

stage_spec() {
    local f="$OUT/spec.jsonl" depth=() steps topk nodes
    IFS=, read -r steps topk nodes <<< "${SPEC_TREE:-2,1,3}"
    [ "$LAYERS" != full ] && depth=(--num-layers "$LAYERS")
    rm -f "$f"
    for l in $LAYOUTS; do
        read -r -a lf <<< "$(python3 benchmarks/layouts.py "$l")"
        for mode in off on; do
            local sf=()
            [ "$mode" = on ] && sf=(--speculative-algorithm NEXTN --speculative-num-steps "$steps"
                                    --speculative-eagle-topk "$topk" --speculative-num-draft-tokens "$nodes")
            # shellcheck disable=SC2086
            timeout "$STAGE_TIMEOUT" python3 -m dsctl bench offline --model "${SPEC_MODEL:-deepseek-v3}" --load-format dummy \
                "${depth[@]}" "${lf[@]}" "${sf[@]}" ${SPEC_FLAGS:-} --input-len "$IN" --output-len "$OUTLEN" \
                --concurrency "${SPEC_CONC:-32}" --repeats 2 --result-file "$f" > "$OUT/spec-$l-$mode.log" 2>&1 \
                || { echo "spec $l $mode failed:"; tail -5 "$OUT/spec-$l-$mode.log"; continue; }
            echo "$l $mode" "$(tail -1 "$f")"
        done
    done | python3 -c '
import json, sys
off = {}
print("layout  spec  batch-1 step ms  spec/decode  speed-up at L=2.0/2.5/3.0  concurrent out tok/s  accepted")
for line in sys.stdin:
    parts = line.split(" ", 2)
    if len(parts) < 3 or not parts[2].startswith("{"):
        print(line.rstrip()); continue
    layout, mode, r = parts[0], parts[1], json.loads(parts[2])
    step = 1e3 * (r.get("accept_length_bs1") or 1.0) / r["decode_tok_s_bs1"]  # a step emits that many tokens
    cells = ["-", "-"]
    if mode == "off":
        off[layout] = step
    elif layout in off:
        ratio = step / off[layout]
        cells = [f"{ratio:.2f}", "/".join(f"{L / ratio:.2f}x" for L in (2.0, 2.5, 3.0))]
    rate, acc = r["output_tok_s"], r.get("accept_length_bs1")
    acc = "-" if acc is None else f"{acc:.2f}"
    print(f"{layout:<7} {mode:<4} {step:>16.2f} {cells[0]:>12} {cells[1]:>26} {rate:>21.1f} {acc:>9}")
'
}

for s in $STAGES; do
    echo "=== $s ($(date +%T))"
    t0=$(date +%s)
    "stage_$s" 2>&1 | tee "$OUT/stage-$s.txt"
    echo "=== $s done in $(( $(date +%s) - t0 )) s"
done
