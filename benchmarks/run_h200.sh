#!/usr/bin/env bash
# Runs on the H200 machine from the repository root; results land in $OUT (default ./out).
# Usage: benchmarks/run_h200.sh STAGE...   stages: tests, tidal-0.6b, tidal-8b, tidal-8b-sampled, hf-0.6b, hf-8b, hf-8b-lite
# (served benchmarks: benchmarks/run_serve_h200.sh)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=engine${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export TIDAL_BENCH_DATE=${TIDAL_BENCH_DATE:-2026-11-29}
PY=${PY:-python3}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout ${T_TESTS:-400} $PY -m pytest -q -p no:cacheprovider -o addopts= \
             -m gpu ${TEST_FILES:-tests/engine/test_kernels.py tests/engine/test_cuda_graphs.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    tidal-0.6b) timeout ${T_TIDAL06:-420} $PY benchmarks/gpu_bench.py --shape qwen3-0.6b --suite tidal --skip ${SKIP06:-none} --out "$OUT/tidal-qwen3-0.6b.json" 2>&1 | cut -c1-400 ;;
    tidal-8b) timeout ${T_TIDAL8:-480} $PY benchmarks/gpu_bench.py --shape qwen3-8b --suite tidal --skip ${SKIP8:-startup_warm} --out "$OUT/tidal-qwen3-8b.json" 2>&1 | cut -c1-400 ;;
    tidal-8b-sampled) timeout ${T_SAMPLED8:-300} $PY benchmarks/gpu_bench.py --shape qwen3-8b --suite sampled --out "$OUT/tidal-qwen3-8b-sampled.json" 2>&1 | cut -c1-400 ;;
    tidal-0.6b-sampled) timeout ${T_SAMPLED06:-240} $PY benchmarks/gpu_bench.py --shape qwen3-0.6b --suite sampled --out "$OUT/tidal-qwen3-0.6b-sampled.json" 2>&1 | cut -c1-400 ;;
    smoke-0.6b) timeout 200 $PY benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --out "$OUT/smoke-qwen3-0.6b.json" 2>&1 | cut -c1-400 ;;
    hf-0.6b) timeout ${T_HF06:-420} $PY benchmarks/gpu_bench.py --shape qwen3-0.6b --suite hf --out "$OUT/hf-qwen3-0.6b.json" 2>&1 | cut -c1-400 ;;
    hf-8b) timeout ${T_HF8:-420} $PY benchmarks/gpu_bench.py --shape qwen3-8b --suite hf --out "$OUT/hf-qwen3-8b.json" 2>&1 | cut -c1-400 ;;
    hf-0.6b-batch) timeout ${T_HF06:-300} $PY benchmarks/gpu_bench.py --shape qwen3-0.6b --suite hf --hf-parts batch --out "$OUT/hf-qwen3-0.6b-batch.json" 2>&1 | cut -c1-400 ;;
    hf-8b-lite) timeout 300 $PY benchmarks/gpu_bench.py --shape qwen3-8b --suite hf --hf-parts static,batch --out "$OUT/hf-qwen3-8b.json" 2>&1 | cut -c1-400 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== end $(date +%T)"
