#!/usr/bin/env bash
# Served benchmarks (issue 13, point 5) on the H200, in one device `run`, from the repository root.
# For each model: make the random-weight folder of the real Qwen3 shape (gpu_bench.make_model_folder),
# start `tidal-engine serve` in the background, wait for /health, run benchmarks/serve_bench.py
# (the issue's load greedy, the same load sampled, then a greedy concurrency sweep), stop the server.
# Optionally (OFFLINE=1) the offline sampled workloads of gpu_bench (--suite sampled) at the end.
#
# One device call (carry .whl, see the wheel notes in the device README):
#   run(command="OFFLINE=1 bash benchmarks/run_serve_h200.sh", carry=[".whl"], timeout_s=600)
# (about 5 minutes on an H200 by estimate; drop OFFLINE=1 to skip the offline sampled workloads)
#
# Results, at most 8 files in $OUT (the device's limit): serve-<model>.json (every workload of
# that model, rewritten after each one), server-<model>.log, offline-sampled-<model>.json,
# run_serve.log (this script's output).
#
# Knobs (environment):
#   MODELS="qwen3-0.6b qwen3-8b"     shapes of gpu_bench.SHAPES (tiny-test tries the script on a CPU)
#   WORKLOADS="greedy sampled sweep" any of: greedy, sampled, sweep, sweep_sampled
#   NUM_PROMPTS=512 INPUT_LEN=256 OUTPUT_LEN=128 CONCURRENCY=256   the issue's load
#   SWEEP=1,16,64,256 SWEEP_FACTOR=2 SWEEP_MIN=16 SWEEP_MAX=512   prompts per point: max(factor x conc, min), <= max
#   TEMPERATURE=0.8 TOP_P=0.95 TOP_K=50                           the sampled workloads
#   NUM_WARMUP=8                    warm-up requests before each serve_bench invocation (not counted)
#   SERVER_FLAGS=""                 extra `tidal-engine serve` flags, e.g. "--api-server-count 2"
#   MAX_MODEL_LEN=4096 MAX_NUM_SEQS=256 PORT=8000 READY_TIMEOUT=300
#   T_BENCH=180                     limit of one serve_bench invocation, seconds
#   OFFLINE=0                       1: gpu_bench --suite sampled for OFFLINE_MODELS (default qwen3-8b) at the end
#   MODELS_DIR=/tmp/tidal-bench-models ENGINE_DIR=$PWD/engine PY=python3
#   WHEELS=.whl                     folder of wheels installed into /tmp/site first (empty: none)
#   BENCH_SEED=0                    serve_bench seeds are BENCH_SEED+1.. (distinct per workload: no prefix-cache hits)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/run_serve.log") 2>&1
ROOT=$(pwd)
PY=${PY:-python3}
MODELS=${MODELS:-qwen3-0.6b qwen3-8b}
WORKLOADS=${WORKLOADS:-greedy sampled sweep}
NUM_PROMPTS=${NUM_PROMPTS:-512}; INPUT_LEN=${INPUT_LEN:-256}; OUTPUT_LEN=${OUTPUT_LEN:-128}; CONCURRENCY=${CONCURRENCY:-256}
SWEEP=${SWEEP:-1,16,64,256}; SWEEP_FACTOR=${SWEEP_FACTOR:-2}; SWEEP_MIN=${SWEEP_MIN:-16}; SWEEP_MAX=${SWEEP_MAX:-512}
TEMPERATURE=${TEMPERATURE:-0.8}; TOP_P=${TOP_P:-0.95}; TOP_K=${TOP_K:-50}
NUM_WARMUP=${NUM_WARMUP:-8}
SERVER_FLAGS=${SERVER_FLAGS:-}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
PORT=${PORT:-8000}; READY_TIMEOUT=${READY_TIMEOUT:-300}; T_BENCH=${T_BENCH:-180}
OFFLINE=${OFFLINE:-0}; OFFLINE_MODELS=${OFFLINE_MODELS:-qwen3-8b}
MODELS_DIR=${MODELS_DIR:-/tmp/tidal-bench-models}
ENGINE_DIR=${ENGINE_DIR:-$ROOT/engine}
BENCH_SEED=${BENCH_SEED:-0}
WHEELS=${WHEELS-.whl}
WORK=$(mktemp -d /tmp/serve-bench.XXXXXX)
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export TIDAL_COMMIT=${TIDAL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s)
now_ms() { date +%s%3N; }
stamp() { echo "=== [+$(( $(date +%s) - T0 ))s $(date -u +%T)] $*"; }
STATUS=0

# ------------------------------------------------------------------ packages
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  stamp "installing $(ls "$WHEELS"/*.whl | wc -l) wheels into /tmp/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "!!! wheel install failed"; exit 1; }
  export PYTHONPATH=$ENGINE_DIR:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ENGINE_DIR${PYTHONPATH:+:$PYTHONPATH}
fi
$PY - <<'EOF' || { echo "!!! the engine's server does not import (missing wheels? see .whl)"; exit 1; }
import platform, fastapi, uvicorn, pydantic, zmq, msgspec, setproctitle
import tidal_engine.server.app  # noqa: F401  (the whole serving path)
try:
    import aiohttp; client = f"aiohttp {aiohttp.__version__}"
except ImportError:
    import httpx; client = f"httpx {httpx.__version__}"
try:
    import httptools; http = f"httptools {httptools.__version__}"
except ImportError:
    http = "h11"
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.cuda.is_available()}"
      f" ({torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}), fastapi {fastapi.__version__}, "
      f"uvicorn {uvicorn.__version__} ({http}), pydantic {pydantic.__version__}, pyzmq {zmq.__version__}, "
      f"msgspec {msgspec.__version__}, bench client {client}")
EOF
stamp "commit $TIDAL_COMMIT; models: $MODELS; workloads: $WORKLOADS; server flags: ${SERVER_FLAGS:-none}"

# ------------------------------------------------------------------ server
SERVER_PID=
SETSID=$(command -v setsid || true)  # without it, only the server's main process is signalled (its children die with it)
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null  # its process group: API servers, engine core, workers
  fi
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap 'stop_server; rm -rf "$WORK"' EXIT

server_alive() { [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null && ! grep -q '^State:.*zombie' "/proc/$SERVER_PID/status" 2>/dev/null; }

server_died() {  # $1: model
  local code
  if server_alive; then code="still running"; else wait "$SERVER_PID" 2>/dev/null; code="exit status $?"; fi
  echo "!!! the server for $1 is not serving ($code); last lines of its log:"
  tail -n 60 "$OUT/server-$1.log" | cut -c1-400
  SERVER_PID=
  STATUS=1
}

wait_ready() {  # $1: model; 0 once /health answers 200 (and /v1/models lists the model)
  local start=$(date +%s)
  while [ $(( $(date +%s) - start )) -lt "$READY_TIMEOUT" ]; do
    server_alive || return 1
    if $PY - "$PORT" "$1" <<'EOF' 2>/dev/null; then
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
assert urllib.request.urlopen(base + "/health", timeout=2).status == 200
models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=2))
assert any(m["id"] == sys.argv[2] for m in models["data"])
EOF
      return 0
    fi
    sleep 1
  done
  echo "!!! the server for $1 was not ready after ${READY_TIMEOUT}s"
  return 1
}

merge_results() {  # $1: model: $OUT/serve-<model>.json = every workload JSON of that model so far
  $PY - "$WORK" "$1" "$OUT/serve-$1.json" <<'EOF'
import glob, json, os, sys
work, model, out = sys.argv[1:]
merged = {"model_shape": model, "commit": os.environ.get("TIDAL_COMMIT"), "server_flags": os.environ.get("SERVER_FLAGS_USED"),
          "timings_s": json.load(open(f"{work}/{model}.timings.json")) if os.path.exists(f"{work}/{model}.timings.json") else {},
          "workloads": {}}
for path in sorted(glob.glob(f"{work}/{model}.*.bench.json")):
    merged["workloads"][os.path.basename(path).split(".")[-3]] = json.load(open(path))
json.dump(merged, open(out, "w"), indent=1)
EOF
}

record_time() {  # $1 model, $2 key, $3 milliseconds
  $PY - "$WORK/$1.timings.json" "$2" "$3" <<'EOF'
import json, os, sys
path, key, value = sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1e3
data = json.load(open(path)) if os.path.exists(path) else {}
data[key] = value
json.dump(data, open(path, "w"))
EOF
}

cpu_ms() {  # $1 a process title (setproctitle): CPU milliseconds (user + system) of this server's such processes
  $PY - "$1" "$SERVER_PID" <<'EOF'
import os, sys
total = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if sys.argv[1] not in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
            continue
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        if fields[1] != sys.argv[2] and fields[2] != sys.argv[2]:
            continue  # another server's: not in this one's process group or session (setsid)
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    except OSError:
        continue
print(total * 1000 // os.sysconf("SC_CLK_TCK"))
EOF
}

# ------------------------------------------------------------------ per model
for model in $MODELS; do
  stamp "$model: model folder"
  t=$(now_ms)
  folder=$($PY - "$model" "$MODELS_DIR" <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from pathlib import Path
from gpu_bench import make_model_folder
print(make_model_folder(sys.argv[1], Path(sys.argv[2])))
EOF
  ) || { echo "!!! could not make the $model folder"; STATUS=1; continue; }
  folder=$(echo "$folder" | tail -n 1)
  record_time "$model" folder_s $(( $(now_ms) - t ))
  vocab=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$folder/config.json")
  stamp "$model: folder $folder ready ($(du -sh "$folder" | cut -f1)), vocab $vocab; starting the server"

  export SERVER_FLAGS_USED="--max-model-len $MAX_MODEL_LEN --max-num-seqs $MAX_NUM_SEQS --disable-log-requests $SERVER_FLAGS"
  t=$(now_ms)
  # setsid: the server leads its own process group, which stop_server can kill as a whole.
  # shellcheck disable=SC2086
  $SETSID $PY -m tidal_engine.cli serve "$folder" --served-model-name "$model" --port "$PORT" \
      $SERVER_FLAGS_USED > "$OUT/server-$model.log" 2>&1 &
  SERVER_PID=$!
  if ! wait_ready "$model"; then server_died "$model"; stop_server; continue; fi
  record_time "$model" server_start_s $(( $(now_ms) - t ))
  stamp "$model: server ready (pid $SERVER_PID)"

  seed=$BENCH_SEED
  for workload in $WORKLOADS; do
    seed=$((seed + 1))
    common=(--base-url "http://127.0.0.1:$PORT" --model "$model" --vocab-size "$vocab" --seed "$seed"
            --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-warmup "$NUM_WARMUP"
            --request-timeout 120 --label "$model $workload tidal $TIDAL_COMMIT"
            --out "$WORK/$model.$workload.bench.json")
    sampled=(--temperature "$TEMPERATURE" --top-p "$TOP_P" --top-k "$TOP_K")
    sweep=(--sweep "$SWEEP" --sweep-prompts-factor "$SWEEP_FACTOR" --sweep-min-prompts "$SWEEP_MIN" --sweep-max-prompts "$SWEEP_MAX")
    load=(--num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY")
    case $workload in
      greedy) args=("${load[@]}" --temperature 0) ;;
      sampled) args=("${load[@]}" "${sampled[@]}") ;;
      sweep) args=("${sweep[@]}" --temperature 0) ;;
      sweep_sampled) args=("${sweep[@]}" "${sampled[@]}") ;;
      *) echo "!!! unknown workload $workload"; STATUS=1; continue ;;
    esac
    stamp "$model: $workload"
    t=$(now_ms); api0=$(cpu_ms "tidal-engine: api-server"); core0=$(cpu_ms "tidal-engine: engine-core")
    timeout "$T_BENCH" $PY benchmarks/serve_bench.py "${common[@]}" "${args[@]}"
    rc=$?
    record_time "$model" "$workload" $(( $(now_ms) - t ))
    # CPU the API servers and the engine core spent on the workload (warm-up included): an API
    # server near one CPU-second per second is the limit, not the GPU.
    record_time "$model" "${workload}_api_server_cpu_s" $(( $(cpu_ms "tidal-engine: api-server") - api0 ))
    record_time "$model" "${workload}_engine_core_cpu_s" $(( $(cpu_ms "tidal-engine: engine-core") - core0 ))
    [ $rc -eq 0 ] || { echo "!!! serve_bench $workload exited with $rc (1: some requests failed, 124: timed out)"; STATUS=1; }
    merge_results "$model"
    server_alive || { server_died "$model"; break; }
  done
  stamp "$model: stopping the server"
  stop_server
  merge_results "$model"
  echo "--- server log tail ($model)"; tail -n 5 "$OUT/server-$model.log" | cut -c1-300
done

# ------------------------------------------------------------------ offline sampled (gpu_bench)
if [ "$OFFLINE" = 1 ]; then
  for model in $OFFLINE_MODELS; do
    stamp "offline sampled: $model"
    timeout "${T_OFFLINE:-240}" $PY benchmarks/gpu_bench.py --shape "$model" --suite sampled --models "$MODELS_DIR" \
      --out "$OUT/offline-sampled-$model.json" 2>&1 | cut -c1-400
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!!! gpu_bench --suite sampled ($model) failed"; STATUS=1; }
  done
fi

stamp "summary"
$PY - "$OUT" <<'EOF'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/serve-*.json")):
    m = json.load(open(path))
    print(f"{m['model_shape']}: timings {json.dumps({k: round(v, 1) for k, v in m['timings_s'].items()})}")
    for name, w in m["workloads"].items():
        for r in w.get("runs", []):
            print(f"  {name:14s} conc {r['concurrency']:4d} n {r['requests']:4d} fail {r['failed']:3d}  "
                  f"{r['output_throughput'] or 0:8.0f} out tok/s  TTFT p50 {r['ttft_ms']['p50'] or 0:8.1f} ms  "
                  f"TPOT p50 {r['tpot_ms']['p50'] or 0:6.2f} p99 {r['tpot_ms']['p99'] or 0:6.2f} ms  "
                  f"ITL p99 {r['itl_ms']['p99'] or 0:7.2f} ms  client cpu {r['client_cpu_util'] or 0:.2f}")
        if "error" in w:
            print(f"  {name}: ERROR {w['error']}")
for path in sorted(glob.glob(f"{sys.argv[1]}/offline-sampled-*.json")):
    m = json.load(open(path))
    for k in ("throughput_fixed_sampled", "throughput_long_sampled", "throughput_fixed_greedy"):
        v = m.get(k, {})
        print(f"offline {m['shape']['name']} {k}: {v.get('output_tok_s', v.get('error'))}")
EOF
stamp "end (status $STATUS)"
exit $STATUS
