#!/bin/bash
# Lead's device call (2026-12-01, fourth session): start-up of main 0bab6bb, the pipelined INT4 GEMV
# candidates (branch int4-staged 69d8481), then main's GPU tests one file per process.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site2 ../../.whl-tf/*.whl || exit 1
mkdir -p $OUT/startup $OUT/gpu $OUT/int4s
echo "=== startup $(date +%T)"
(
  export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site2:/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
  unset PYTHONDONTWRITEBYTECODE
  python3 -c "import torch, triton, transformers; from transformers import AutoTokenizer, PreTrainedTokenizerFast; import tidal_engine.entrypoints.llm"
  TIDAL_COMMIT=0bab6bb TIDAL_BENCH_DATE=2026-12-01 timeout 210 python3 benchmarks/memory_bench.py all --out $OUT/startup       --stages write,engine,construct --stage-timeout 90 > $OUT/startup/bench.log 2>&1
  echo "startup rc=$?"; grep -E '^=== |"construct_s"' $OUT/startup/bench.log | cut -c1-300
)
echo "=== int4-staged $(date +%T)"
(
  cd ../int4s
  export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TIDAL_BENCH_LOG=INFO TIDAL_COMMIT=69d8481 TIDAL_BENCH_DATE=2026-12-01
  timeout 50 python3 benchmarks/int4_micro.py --out $OUT/int4s/int4-micro.json > $OUT/int4s/micro-log.txt 2>&1; echo "micro rc=$?"; tail -12 $OUT/int4s/micro-log.txt | cut -c1-200
  timeout 90 python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --quantization gptq --out $OUT/int4s/quant-qwen3-8b-gptq.json > $OUT/int4s/bench-log-gptq.txt 2>&1; echo "gptq rc=$?"
  grep -E "single_stream|output_tok_s_median|one_row_kernels|Traceback|Error" $OUT/int4s/bench-log-gptq.txt | cut -c1-300 | tail -8
)
echo "=== gpu tests $(date +%T)"
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
for f in test_kv_fp8_kernels test_quantization_kernels test_spec_decode_gpu test_cuda_graphs test_gemv test_qkv_prologue test_kv_offload test_loader test_split_kv_attention test_kernels; do
  echo "--- $f $(date +%T)" >> $OUT/gpu/gpu-tests.txt
  timeout 45 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/$f.py >> $OUT/gpu/gpu-tests.txt 2>&1; echo "rc $?" >> $OUT/gpu/gpu-tests.txt
  echo "$f: $(grep -E 'passed|failed|error' $OUT/gpu/gpu-tests.txt | tail -1)"
done
echo "=== end $(date +%T)"
