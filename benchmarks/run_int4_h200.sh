#!/usr/bin/env bash
# INT4 kernels on the H200 (issue 15), one device call: the gpu-marked kernel tests, gpu_bench's
# quant suite for ${QUANTS} (default gptq and awq; one process each), then the one-row micro-timing
# (benchmarks/int4_micro.py --rows ${MICRO_ROWS}, with the folded gate|up), every step bounded by
# `timeout`. Results land in $OUT (default ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=engine:operator${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TIDAL_BENCH_LOG=INFO
export TIDAL_BENCH_DATE=${TIDAL_BENCH_DATE:-2026-12-02}
PY=${PY:-python3}
echo "=== tests $(date +%T)"
# The INT4 gpu tests: the packed-halves GEMV's file and the INT4 ones of the kernels file.
timeout ${T_TESTS:-120} $PY -m pytest -q -p no:cacheprovider -o addopts= -m gpu --durations=12 \
  tests/engine/test_quant_int4_packed.py tests/engine/test_quantization_kernels.py \
  -k "int4 or packed or choice_sets or split_k" > "$OUT/gpu-tests.txt" 2>&1; echo "rc $?" >> "$OUT/gpu-tests.txt"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests.txt" | tail -8
for quant in ${QUANTS:-gptq awq}; do
  echo "=== $quant $(date +%T)"
  limit=${T_BENCH:-100}; [ $quant = awq ] && limit=${T_BENCH_AWQ:-60}  # awq reuses gptq's stored choices
  timeout $limit $PY benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --quantization $quant \
    --out "$OUT/quant-qwen3-8b-$quant.json" > "$OUT/bench-log-$quant.txt" 2>&1; echo "rc $?"
  grep -E "single_stream|output_tok_s_median|Traceback|Error" "$OUT/bench-log-$quant.txt" | cut -c1-300 | tail -5
done
echo "=== micro $(date +%T)"
timeout ${T_MICRO:-110} $PY benchmarks/int4_micro.py --rows ${MICRO_ROWS:-1 4 16 128} --out "$OUT/int4-micro.json" 2>&1 \
  | tail -30
echo "=== end $(date +%T)"
