#!/bin/bash
# Lead's device call (2026-12-01, fifth session): why sampled trails greedy (issue 13), FP8 single
# stream of main with the six landed GEMV tiles (issue 15), and the GPU tests the helpers changed
# after their calls (INT4 test fix, the attention's new bf16 default launch).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
timeout 170 python3 benchmarks/sampled_host_diag.py --shape qwen3-8b --out $OUT/sampled_host_diag.json > $OUT/diag-log.txt 2>&1
echo "diag rc=$? t=$SECONDS"; grep -E '^--- |output_tok_s|allocator' $OUT/diag-log.txt | cut -c1-400
timeout 80 python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed --quantization fp8 --out $OUT/quant-qwen3-8b-fp8.json > $OUT/quant-log.txt 2>&1
echo "fp8 rc=$? t=$SECONDS"; grep -E 'output_tok_s' $OUT/quant-log.txt | cut -c1-300
P="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu"
for f in tests/engine/test_quantization_kernels.py tests/engine/test_gemv.py tests/engine/test_split_kv_attention.py tests/engine/test_kernels.py tests/engine/test_kv_fp8_kernels.py; do
  R=$((390-SECONDS)); [ $R -lt 15 ] && { echo "no time for $f"; continue; }
  timeout $R $P $f >> $OUT/gpu-tests.txt 2>&1; echo "$f rc=$? t=$SECONDS"; tail -1 $OUT/gpu-tests.txt
done
