#!/usr/bin/env bash
# dsctl serve on one GPU under rising load, measured with dsctl bench serving (random prompts of exactly
# IN tokens, exactly OUT output tokens), one server for the whole sweep. After each level it reads
# /metrics: KV free plus what the prefix cache holds (evictable) must be back to the pool size (no leak),
# no request left running, and the engine must still be up. Prompts repeat across levels (same seed):
# later levels hit the prefix cache, as shared system prompts do.
# Writes $OUT/<tag>-serve.log, $OUT/<tag>.jsonl (one bench record per level), $OUT/<tag>-c<conc>.requests.jsonl
# (every request's chunk times) and prints a table.
#   TAG=v3 MODEL=deepseek-v3 LAYERS=5 CONCS="1 8 32 128 256 512 1024" bash benchmarks/serve_sweep.sh
#   TAG=v3 ... TREE=.peer/before bash benchmarks/serve_sweep.sh   (the server from another checkout)
#   TAG=v3-dp LAYOUT=tp2-dp2 bash benchmarks/serve_sweep.sh   (a parallel layout, benchmarks/layouts.py; the floor
#   is then per GPU of that layout)
#   TAG=start CONCS= bash benchmarks/serve_sweep.sh   (start-up only: time to healthy and the ranks' phases)
#   PROFILE_S=1 ... bash benchmarks/serve_sweep.sh   (each level from 2 streams up is also profiled for PROFILE_S
#   seconds, PROFILE_AT s after it starts: POST /start_profile, /stop_profile; per rank its steps and the time
#   per step in collectives and exposed; the traces under $OUT/$TAG-profiles; that level's latency tails then
#   include the profiler's own stalls, seconds on CPU: compare levels without it)
set -u
OUT=${OUT:-$PWD/serve-out}; TAG=${TAG:-sweep}; MODEL=${MODEL:-deepseek-v3}; LAYERS=${LAYERS:-5}
CONCS=${CONCS-"1 8 32 128 256 512 1024"}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-256}; PORT=${PORT:-30555}  # CONCS=: no level
TREE=${TREE:-.}; EXTRA=${EXTRA:-}; LAYOUT=${LAYOUT:-tp1}
mkdir -p "$OUT"
read -r -a layout_flags <<< "$(python3 benchmarks/layouts.py "$LAYOUT")" || exit 1
layers=(); [ "$LAYERS" != full ] && layers=(--num-layers "$LAYERS")
PROFILE_S=${PROFILE_S:-}; PROFILE_AT=${PROFILE_AT:-10}
profile=(); [ -n "$PROFILE_S" ] && profile=(--profile-dir "$OUT/$TAG-profiles")
# copy bandwidth for the bytes floor of the table's last column, measured before the server takes the memory
bw=$(python3 -c "import sys; sys.path.insert(0, '.'); from engine.distributed.step_floor import copy_bandwidth; print(copy_bandwidth())" 2>/dev/null || echo nan)
# A server started right after another one exited can find that one's ranks still holding GPU memory (the
# memory plan then shrinks the pool or refuses to start): wait, up to IDLE_WAIT_S, for every GPU to hold less
# than IDLE_MIB.
gpu_busy_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1; }
for _ in $(seq $(( ${IDLE_WAIT_S:-60} * 2 ))); do
    used=$(gpu_busy_mib); [ -z "$used" ] || [ "$used" -lt "${IDLE_MIB:-4096}" ] && break
    sleep 0.5
done
[ -n "$used" ] && [ "$used" -ge "${IDLE_MIB:-4096}" ] && echo "$TAG: warning: a GPU still holds $used MiB at start"
start=$(date +%s.%N)
# shellcheck disable=SC2086
(cd "$TREE" && exec python3 -m dsctl serve --model "$MODEL" --load-format dummy "${layers[@]}" "${profile[@]}" --port "$PORT" \
    --max-model-len 4096 "${layout_flags[@]}" $EXTRA) > "$OUT/$TAG-serve.log" 2>&1 &
pid=$!
for _ in $(seq $(( ${HEALTH_WAIT_S:-300} * 2 ))); do  # a cold start at full depth takes minutes
    curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
done
curl -sf "127.0.0.1:$PORT/health" >/dev/null || { echo "$TAG: server not healthy"; tail -30 "$OUT/$TAG-serve.log"; kill $pid; exit 1; }
healthy_s=$(python3 -c "import time; print(round(time.time() - $start, 1))")
echo "$TAG: healthy after $healthy_s s"
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat" 2>/dev/null || echo 0; }
kv() { curl -sf "127.0.0.1:$PORT/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
for c in $CONCS; do
    n=$(( c < 8 ? 8 : (c < 128 ? 2 * c : c) ))
    s0=$(cpu_s $pid)
    curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/$TAG-c$c.m0"
    profiling=
    if [ -n "$PROFILE_S" ] && [ "$c" -ge 2 ]; then  # a window of the level's steady state, every rank
        ( sleep "$PROFILE_AT"; curl -sf -X POST "127.0.0.1:$PORT/start_profile" > /dev/null && sleep "$PROFILE_S" &&
          curl -sf -X POST "127.0.0.1:$PORT/stop_profile" > "$OUT/$TAG-c$c.profile.json" ) &
        profiling=$!
    fi
    { time -p python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" \
        --max-concurrency "$c" --random-input-len "$IN" --random-output-len "$OUTLEN" \
        --result-file "$OUT/$TAG.jsonl" --request-file "$OUT/$TAG-c$c.requests.jsonl" > "$OUT/$TAG-c$c.txt" 2>&1; } \
        2> "$OUT/$TAG-c$c.time"
    rc=$?
    if [ -n "$profiling" ]; then
        wait "$profiling"
        python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['ranks']:
    n = max(r['steps'], 1)
    print(f\"profile c={sys.argv[2]} rank {r['rank']}: {r['steps']} steps, per step busy {r['busy_ms'] / n:.2f} ms, \"
          f\"collectives {r['comm_ms'] / n:.2f} ms, exposed {r['exposed_comm_ms'] / n:.2f} ms ({r['source']}) {r['error']}\")
" "$OUT/$TAG-c$c.profile.json" "$c" 2>/dev/null || echo "profile c=$c: none (the level ended before the window?)"
    fi
    # CPU seconds over wall seconds of the benchmark client (all its processes; the busiest one's share is the
    # table's last column) and of the HTTP server process (near 1.0: it was busy all along, and streamed chunks
    # may bunch up: an ITL median near 0 says so)
    awk -v s0="$s0" -v s1="$(cpu_s $pid)" '{t[$1] = $2} END {printf "client cpu/wall %.2f, server cpu/wall %.2f\n", (t["user"] + t["sys"]) / t["real"], (s1 - s0) / t["real"]}' "$OUT/$TAG-c$c.time"
    sleep 1
    curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/$TAG-c$c.m1"
    # the engine's steps over this level, by kind: how many ran longer than a stream should wait
    python3 benchmarks/step_times.py "$OUT/$TAG-c$c.m0" "$OUT/$TAG-c$c.m1"
    alive=yes; kill -0 $pid 2>/dev/null || alive=NO
    echo "$TAG c=$c n=$n bench_rc=$rc engine_alive=$alive kv_free=$(kv dsctl_kv_cache_free_tokens)+cached=$(kv dsctl_prefix_cache_tokens)/$(kv dsctl_kv_cache_total_tokens) running=$(kv dsctl_num_requests_running) retracted=$(kv dsctl_retracted_requests_total)"
    [ $alive = yes ] || { tail -40 "$OUT/$TAG-serve.log"; break; }
done
t_stop=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?
echo "$TAG server exit $rc after $(python3 -c "import time; print(f'{time.time() - $t_stop:.1f}')") s"
grep -q "did not exit within" "$OUT/$TAG-serve.log" && echo "$TAG: engine ranks outlived the shutdown request (killed)"
grep -E "start-up|startup|phase|weights|KV|graph" "$OUT/$TAG-serve.log" | head -12
echo "$TAG: Triton compiles while serving: $(grep -c "compiled .* while serving" "$OUT/$TAG-serve.log")"
grep "compiled .* while serving" "$OUT/$TAG-serve.log" | head -5
# what the engine flags as stalls: garbage collections over 50 ms (engine/runtime/heap.py) and decode steps over
# 100 ms and 4x the recent ones (the scheduler)
echo "$TAG: slow garbage collections: $(grep -c "garbage collection paused" "$OUT/$TAG-serve.log"), slow decode steps: $(grep -c "a decode step of" "$OUT/$TAG-serve.log")"
grep -E "garbage collection paused|a decode step of" "$OUT/$TAG-serve.log" | cut -c1-240 | head -5
MAXRUN=${MAXRUN:-256}  # the server's --max-running-requests (its default; per DP group)
quant=none; case " $EXTRA " in *" --quantization fp8 "*) quant=fp8 ;; *" --quantization w4afp8 "*) quant=w4afp8 ;; esac
kv_bytes=2; case " $EXTRA " in *" --kv-cache-dtype fp8"*) kv_bytes=1 ;; esac
python3 - "$OUT/$TAG.jsonl" "$TAG" "$MODEL" "$LAYERS" "$bw" "$MAXRUN" "$LAYOUT" "$quant" "$healthy_s" "$EXTRA" \
    "$OUT/$TAG-serve.log" "$kv_bytes" <<'PY'
import json, math, os, sys
sys.path.insert(0, ".")
from engine.distributed.step_floor import serving_floor_ms
from benchmarks.layouts import split
from benchmarks.layout_table import summary
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []  # CONCS=: none
model, layers, bw, maxrun = sys.argv[3], (0 if sys.argv[4] == "full" else int(sys.argv[4])), float(sys.argv[5]), int(sys.argv[6])
tp, dp = split(sys.argv[7])
maxrun *= dp
f = lambda r: r["flags"]
print(f"\n{sys.argv[2]} ({sys.argv[7]}): random {f(rows[0])['random_input_len']} in / {f(rows[0])['random_output_len']} out" if rows else "no rows")
print(f"copy bandwidth {bw / 1e12:.2f} TB/s; floor: bytes one GPU's decode step at the running batch "
      f"(min(conc, {maxrun}), context in + out/2) must read / that bandwidth")
print(f"{'conc':>5} {'ok':>5} {'fail':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
      f"{'TPOT p50':>8} {'floor ms':>8} {'ITL50/floor':>11} {'client':>7}")
for r in rows:
    s = lambda k, q: (r.get(k) or {}).get(q, float('nan'))
    conc = f(r)['max_concurrency']
    ctx = f(r)['random_input_len'] + f(r)['random_output_len'] // 2
    floor = (serving_floor_ms(model, layers, min(conc, maxrun), ctx, bw, tp, dp, quantization=sys.argv[8],
                              kv_bytes=int(sys.argv[12]))
             if not math.isnan(bw) else float('nan'))
    print(f"{conc:>5} {r['completed']:>5} {r['failed']:>4} {r['output_throughput']:9.0f} "
          f"{s('ttft_ms','median'):9.1f} {s('ttft_ms','p99'):9.1f} {s('itl_ms','median'):8.2f} {s('itl_ms','p99'):8.2f} "
          f"{s('tpot_ms','median'):8.2f} {floor:8.2f} {s('itl_ms','median') / floor:11.2f} "
          f"{r.get('client_processes', 1)}x{100 * (r.get('client_busy') or float('nan')):3.0f}%")
    r["floor_ms"] = floor
# one JSON line for benchmarks/layout_table.py: start-up, memory, and every level with its floor
with open(sys.argv[1][:-len(".jsonl")] + ".summary.json", "w") as out:
    log = open(sys.argv[11], errors="replace").read() if os.path.exists(sys.argv[11]) else ""
    json.dump(summary(sys.argv[2], sys.argv[7], model, sys.argv[10], float(sys.argv[9]), bw, log, rows), out)
PY
