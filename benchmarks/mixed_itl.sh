#!/usr/bin/env bash
# Issue 15, acceptance 5: inter-token latency of steady streams while long prompts keep arriving, with mixed
# batches off (the default: prefill steps and decode steps alternate) and on (--enable-mixed-chunk:
# the running requests decode inside every prefill step). One fresh `dsctl serve` per mode, same workload:
#   - short: SHORT_N requests of SHORT_IN prompt / SHORT_OUT output tokens, SHORT_CONC in flight (the streams
#     whose ITL is measured);
#   - long:  LONG_N prompts of LONG_IN tokens (LONG_OUT output tokens) arriving at LONG_RATE per second (Poisson),
#     started LONG_DELAY s after the short client so that they land on running streams.
# Both clients are `dsctl bench serving` (random token-id prompts of exactly the asked lengths, distinct seeds so
# that nothing is a prefix-cache hit). A warm-up round of both kinds (other seeds) runs first on each server so
# that Triton JIT compilation is not measured. Prints one table: short-stream ITL p50/p90/p99, TPOT p50 and
# output tok/s, long-prompt TTFT, failures, and on/off ratios; before it, per mode, the server's step times by
# kind (decode / extend / mixed) over the measured round, from /metrics (benchmarks/step_times.py).
#   bash benchmarks/mixed_itl.sh                      (V3, 5 layers, dummy FP8: ~5 minutes on an H100)
#   CHUNK=8192 LONG_IN=7680 bash benchmarks/mixed_itl.sh
#   MODEL=deepseek-v2-lite LAYERS=full bash benchmarks/mixed_itl.sh
# Writes $OUT/mixed-{off,on}-serve.log, $OUT/mixed-{off,on}-{short,long,warm}.{jsonl,txt}, -metrics-{before,after}.txt.
# The GPU image lacks the server's Python packages (uvicorn, starlette, ...): `bash benchmarks/mixed_itl.sh
# --bundle`, run where they are installed, copies them into $SITE (default .whl/site, git-ignored; carry it
# with the run), which this script puts on PYTHONPATH when a package is missing; TARGET_PY=3.12 (the GPU's Python)
# also fetches pydantic_core, the one compiled package, for that Python. Without them it stops at once.
set -u -o pipefail
SITE=${SITE:-.whl/site}
if [ "${1:-}" = --bundle ]; then
    exec python3 - "$SITE" "${TARGET_PY:-}" <<'PY'
import importlib, pathlib, shutil, subprocess, sys, tempfile, zipfile
dst, target_py = pathlib.Path(sys.argv[1]), sys.argv[2]
dst.mkdir(parents=True, exist_ok=True)
mods = ("uvicorn starlette h11 anyio sniffio idna prometheus_client httpx httpcore certifi pydantic pydantic_core "
        "annotated_types typing_inspection typer click rich markdown_it mdurl shellingham pygments typing_extensions")
for name in mods.split():
    try:
        f = pathlib.Path(importlib.import_module(name).__file__)
    except ImportError:
        print(f"skip {name} (not installed here)"); continue
    src = f.parent if f.name == "__init__.py" else f
    target = dst / src.name
    if target.exists():
        continue
    if src.is_dir():
        shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(src, target)
    print(f"{name}: {src} -> {target}")
if target_py:  # pydantic_core is compiled: fetch the wheel of the same version for the GPU's Python
    import pydantic_core
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"pydantic-core=={pydantic_core.__version__}",
                        "--python-version", target_py, "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
                        "--no-deps", "-q", "-d", tmp], check=True)
        shutil.rmtree(dst / "pydantic_core", ignore_errors=True)
        for whl in pathlib.Path(tmp).glob("*.whl"):
            zipfile.ZipFile(whl).extractall(dst)
            print(f"pydantic_core for Python {target_py}: {whl.name}")
PY
fi
OUT=${OUT:-$PWD/serve-out}; MODEL=${MODEL:-deepseek-v3}; LAYERS=${LAYERS:-5}; PORT=${PORT:-30557}
CHUNK=${CHUNK:-2048}; EXTRA=${EXTRA:-}
SHORT_IN=${SHORT_IN:-256}; SHORT_OUT=${SHORT_OUT:-512}; SHORT_CONC=${SHORT_CONC:-32}; SHORT_N=${SHORT_N:-96}
LONG_IN=${LONG_IN:-6144}; LONG_OUT=${LONG_OUT:-16}; LONG_RATE=${LONG_RATE:-1}; LONG_N=${LONG_N:-30}
LONG_DELAY=${LONG_DELAY:-3}; MODES=${MODES:-"off on"}
layers=(); [ "$LAYERS" != full ] && layers=(--num-layers "$LAYERS")  # LAYERS=full: the model's depth
MAX_LEN=$(( LONG_IN + LONG_OUT > SHORT_IN + SHORT_OUT ? LONG_IN + LONG_OUT : SHORT_IN + SHORT_OUT ))
MAX_LEN=$(( MAX_LEN + 64 ))
mkdir -p "$OUT"
missing_modules() {
    python3 - <<'PY'
import importlib.util as u
mods = ["torch", "triton", "typer", "rich", "uvicorn", "starlette", "prometheus_client", "pydantic", "httpx",
        "tokenizers", "transformers", "numpy"]
print(" ".join(m for m in mods if u.find_spec(m) is None))
PY
}
missing=$(missing_modules) || { echo "python3 failed"; exit 2; }
if [ -n "$missing" ] && [ -d "$SITE" ]; then  # only then: the bundle must not shadow what is installed
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$(cd "$SITE" && pwd)"
    missing=$(missing_modules) || { echo "python3 failed"; exit 2; }
fi
[ -z "$missing" ] || { echo "missing python packages: $missing (bundle them into $SITE, see the header)"; exit 2; }
curl -sf "127.0.0.1:$PORT/health" >/dev/null && { echo "port $PORT already serves something: set PORT"; exit 2; }

pid=""
stop_server() {  # SIGTERM, then SIGKILL after 60 s; the engine ranks die with the server (PDEATHSIG)
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { echo "server $pid ignored SIGTERM for 60 s: killing it"; kill -KILL "$pid"; }
    wait "$pid" 2>/dev/null; rc=$?; pid=""; return $rc
}
trap 'stop_server; exit 130' INT TERM
trap 'stop_server' EXIT

bench() {  # tag kind seed n in out [bench serving options...]
    local tag=$1 kind=$2 seed=$3 n=$4 in=$5 out=$6; shift 6
    python3 -m dsctl bench serving --base-url "http://127.0.0.1:$PORT" --num-prompts "$n" --seed "$seed" \
        --random-input-len "$in" --random-output-len "$out" --result-file "$OUT/$tag-$kind.jsonl" "$@" \
        > "$OUT/$tag-$kind.txt" 2>&1
}

round() {  # tag kind-suffix seed-base short_n long_n: both clients at once; non-zero if either fails
    local tag=$1 sfx=$2 s=$3 sn=$4 ln=$5
    bench "$tag" "short$sfx" "$s" "$sn" "$SHORT_IN" "$SHORT_OUT" --max-concurrency "$SHORT_CONC" &
    local short=$!
    sleep "$LONG_DELAY"
    bench "$tag" "long$sfx" $((s + 1)) "$ln" "$LONG_IN" "$LONG_OUT" --request-rate "$LONG_RATE" &
    local long=$!
    local rc=0
    wait $short || { echo "$tag: short client failed (rc $?): tail of $OUT/$tag-short$sfx.txt"; tail -5 "$OUT/$tag-short$sfx.txt"; rc=1; }
    wait $long || { echo "$tag: long client failed (rc $?): tail of $OUT/$tag-long$sfx.txt"; tail -5 "$OUT/$tag-long$sfx.txt"; rc=1; }
    return $rc
}

failed=0
for mode in $MODES; do
    tag=mixed-$mode
    flag=""; [ "$mode" = on ] && flag=--enable-mixed-chunk
    rm -f "$OUT/$tag"-*.jsonl
    start=$(date +%s)
    # shellcheck disable=SC2086
    python3 -m dsctl serve --model "$MODEL" --load-format dummy "${layers[@]}" --port "$PORT" \
        --max-model-len "$MAX_LEN" --chunked-prefill-size "$CHUNK" $flag $EXTRA > "$OUT/$tag-serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do
        curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if ! curl -sf "127.0.0.1:$PORT/health" >/dev/null; then
        echo "$tag: server not healthy (exit or 300 s timeout); tail of $OUT/$tag-serve.log:"; tail -30 "$OUT/$tag-serve.log"
        stop_server; exit 1
    fi
    echo "$tag (${flag:-mixed batches off} --chunked-prefill-size $CHUNK): healthy after $(( $(date +%s) - start )) s"
    round "$tag" -warm 1000 "$SHORT_CONC" 3 || { failed=1; stop_server; continue; }
    curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/$tag-metrics-before.txt"
    round "$tag" "" 1 "$SHORT_N" "$LONG_N" || failed=1
    curl -sf "127.0.0.1:$PORT/metrics" > "$OUT/$tag-metrics-after.txt" &&
        { echo "$tag: scheduler steps of the measured round (dsctl_step_seconds)";
          python3 benchmarks/step_times.py "$OUT/$tag-metrics-before.txt" "$OUT/$tag-metrics-after.txt"; }
    kill -0 "$pid" 2>/dev/null || { echo "$tag: the server died"; tail -30 "$OUT/$tag-serve.log"; failed=1; }
    stop_server; echo "$tag: server exit $?"
done

python3 - "$OUT" "$MODES" <<'PY'
import json, os, sys
out, modes = sys.argv[1], sys.argv[2].split()
def rec(mode, kind):
    p = os.path.join(out, f"mixed-{mode}-{kind}.jsonl")
    return json.loads(open(p).read().splitlines()[-1]) if os.path.exists(p) and os.path.getsize(p) else None
def q(r, key, p):
    return float("nan") if r is None or not r.get(key) else r[key][p]
rows = {}
print(f"\n{'mixed':>5} {'short ok/fail':>13} {'ITL p50':>8} {'ITL p90':>8} {'ITL p99':>8} {'TPOT p50':>8} "
      f"{'short tok/s':>11} {'long ok/fail':>12} {'long TTFT p50':>13} {'long TTFT p99':>13} {'all tok/s':>9}")
for m in modes:
    s, l = rec(m, "short"), rec(m, "long")
    if s is None or l is None:
        print(f"{m:>5} (no results)"); continue
    rows[m] = (s, l)
    print(f"{m:>5} {s['completed']:>7}/{s['failed']:<5} {q(s,'itl_ms','median'):8.2f} {q(s,'itl_ms','p90'):8.2f} "
          f"{q(s,'itl_ms','p99'):8.2f} {q(s,'tpot_ms','median'):8.2f} {s['output_throughput']:11.0f} "
          f"{l['completed']:>6}/{l['failed']:<5} {q(l,'ttft_ms','median'):13.1f} {q(l,'ttft_ms','p99'):13.1f} "
          f"{s['output_throughput'] + l['output_throughput']:9.0f}")
if "on" in rows and "off" in rows:
    (s1, l1), (s0, l0) = rows["on"], rows["off"]
    r = lambda a, b: a / b if b else float("nan")
    print(f"on/off: ITL p99 {r(q(s1,'itl_ms','p99'), q(s0,'itl_ms','p99')):.2f}x, "
          f"ITL p50 {r(q(s1,'itl_ms','median'), q(s0,'itl_ms','median')):.2f}x, "
          f"short tok/s {r(s1['output_throughput'], s0['output_throughput']):.2f}x, "
          f"long TTFT p50 {r(q(l1,'ttft_ms','median'), q(l0,'ttft_ms','median')):.2f}x")
PY
exit $failed
