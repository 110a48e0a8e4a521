#!/bin/bash
# Lead's first device call (2026-12-02, ninth session), issue 15: the packed INT4 GEMV without the
# wrapped prefetch (nowrap) against main in one call. Run from .dev/: base/ is main at its COMMIT,
# nowrap/ is main plus the masked last prefetch. Base: gpu_bench --suite quant gptq (single stream and
# decode_gpu's kernel list) and int4_micro at one row; nowrap: run_int4_h200.sh (INT4 gpu tests, the
# same bench, the same micro).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TIDAL_BENCH_LOG=INFO
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
( cd base && export TIDAL_COMMIT=$(cat COMMIT) PYTHONPATH=engine:operator:/tmp/site
  echo "=== base bench $(date +%T) $TIDAL_COMMIT"
  timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --quantization gptq \
    --skip throughput_fixed --out "$OUT/base-quant-qwen3-8b-gptq.json" > /tmp/base-log.txt 2>&1; echo "rc $?"
  grep -E "single_stream|Traceback|Error" /tmp/base-log.txt | cut -c1-300 | tail -5
  echo "=== base micro $(date +%T)"
  timeout 45 python3 benchmarks/int4_micro.py --rows 1 --out "$OUT/base-int4-micro.json" 2>&1 | tail -20 )
( cd nowrap && export TIDAL_COMMIT=$(cat COMMIT)
  T_TESTS=60 T_BENCH=100 QUANTS=gptq MICRO_ROWS=1 T_MICRO=45 OUT=$OUT bash benchmarks/run_int4_h200.sh )
