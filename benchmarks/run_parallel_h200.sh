#!/usr/bin/env bash
# Issue 14 on two H200s, in one device `run`, from the repository root: the TP=2 GPU tests (bf16,
# NCCL all-reduces in CUDA graphs) and single-GPU regression tests of the layers they share, then
# benchmarks/parallel_bench.py per configuration (one process each), then the served benchmark at TP=2.
#
#   run(kind="nvidia-h200-x2", command="bash benchmarks/run_parallel_h200.sh", carry=[".whl"])
#
# PP=2 vs PP=1 (several micro-batches in flight), one command:
#   CONFIGS="qwen3-8b:1:1 qwen3-8b:1:2" TEST_FILES=tests/engine/test_tensor_parallel_gpu.py SERVE=0 bash benchmarks/run_parallel_h200.sh
#
# Knobs: CONFIGS (shape:tp:pp[:dummy] ...), TEST_FILES, SERVE=1 (served benchmark at TP=2 on qwen3-8b, greedy
# workload), TESTS=1, T_CONFIG=200 (limit per configuration, seconds). Results in $OUT (at most 8 files).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PY:-python3}
CONFIGS=${CONFIGS:-qwen3-8b:1:1 qwen3-8b:2:1 qwen3-32b:2:1:dummy}
SERVE=${SERVE:-1}; TESTS=${TESTS:-1}; T_CONFIG=${T_CONFIG:-200}
TEST_FILES=${TEST_FILES:-tests/engine/test_tensor_parallel_gpu.py tests/engine/test_gemv.py tests/engine/test_cuda_graphs.py}
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)
stamp() { echo "=== [+$(( $(date +%s) - T0 ))s $(date -u +%T)] $*"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/engine:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$TESTS" = 1 ]; then
  stamp "GPU tests"
  # shellcheck disable=SC2086
  timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu $TEST_FILES > "$OUT/gpu-tests.log" 2>&1
  echo "pytest exit $?"; tail -n 25 "$OUT/gpu-tests.log"
fi
for c in $CONFIGS; do
  IFS=: read -r shape tp pp dummy <<< "$c"
  stamp "parallel_bench $shape tp=$tp pp=$pp ${dummy:-}"
  timeout "$T_CONFIG" $PY benchmarks/parallel_bench.py --shape "$shape" --tp "$tp" --pp "$pp" ${dummy:+--dummy} \
      --out "$OUT/parallel-$shape-tp$tp-pp$pp.json" 2>&1 | grep -v "^\s*$" | tail -n 30
done
if [ "$SERVE" = 1 ]; then
  stamp "served benchmark at TP=2"
  MODELS=qwen3-8b WORKLOADS=greedy SERVER_FLAGS="--tensor-parallel-size 2" WHEELS= T_BENCH=150 READY_TIMEOUT=240 \
      OUT="$OUT" bash benchmarks/run_serve_h200.sh > /dev/null 2>&1
  echo "served exit $?"; tail -n 20 "$OUT/run_serve.log"
fi
$PY benchmarks/parallel_bench.py --summarize "$OUT" | tail -n 40  # ratios to TP=1 × PP=1 → $OUT/summary.json
stamp "done"
