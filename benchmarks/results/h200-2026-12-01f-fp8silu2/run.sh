#!/bin/bash
# fp8silu2 device call (issue 15, FP8 single stream; SiLU-and-mul in the gate_up GEMV epilogue): GPU tests of the touched files (each
# file its own process, bounded): the FP8 ones, the folded GEMV's exactness and timing, the FP8 and
# bf16 single-stream benches, the activation kernel's and test_gemv.py's GPU tests, then the INT4
# GPU tests of test_quantization_kernels.py if time is left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-01 TIDAL_BENCH_LOG=INFO
R=${R:?set R to the results folder holding this script and fold_check.py}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
P="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu"
timeout 70 $P tests/engine/test_quantization_kernels.py -k "fp8 or silu or activation or choice" > $OUT/gpu-tests.txt 2>&1; echo "quant fp8 tests rc=$? t=$SECONDS"; tail -1 $OUT/gpu-tests.txt
timeout 25 python3 $R/fold_check.py > $OUT/fold-check.txt 2>&1; echo "fold check rc=$? t=$SECONDS"; cat $OUT/fold-check.txt | cut -c1-300
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
echo "=== [$SECONDS s] quant fp8" > $OUT/bench-log.txt
timeout 75 $B --quantization fp8 --out $OUT/quant-qwen3-8b-fp8.json >> $OUT/bench-log.txt 2>&1; echo "fp8 rc=$? t=$SECONDS"
echo "=== [$SECONDS s] quant none" >> $OUT/bench-log.txt
timeout 50 $B --quantization none --out $OUT/quant-qwen3-8b-none.json >> $OUT/bench-log.txt 2>&1; echo "none rc=$? t=$SECONDS"
python3 -c "
import json,glob,os
for f in sorted(glob.glob(os.environ['OUT']+'/*.json')):
    for k,v in json.load(open(f)).items():
        if k.startswith('quant_') and isinstance(v,dict):
            s=v.get('single_stream',{}); print(k, s.get('output_tok_s_median'), s.get('decode_tok_s_median'), v.get('llm_construct_s'), str(v.get('error',''))[:300])
"
grep -E "one-row linear|row fp8 linear|Error|error|captured" $OUT/bench-log.txt | cut -c1-300 | head -20
timeout 15 $P tests/engine/test_kernels.py -k silu >> $OUT/gpu-tests.txt 2>&1; echo "kernels silu tests rc=$? t=$SECONDS"; tail -1 $OUT/gpu-tests.txt
L=$((290-SECONDS)); [ $L -lt 10 ] && L=10; timeout $L $P tests/engine/test_gemv.py >> $OUT/gpu-tests.txt 2>&1; echo "gemv tests rc=$? t=$SECONDS"; tail -1 $OUT/gpu-tests.txt
L=$((293-SECONDS)); [ $L -gt 15 ] && { timeout $L $P tests/engine/test_quantization_kernels.py -k "not (fp8 or silu or activation or choice)" > $OUT/gpu-tests-int4.txt 2>&1; echo "quant int4 tests rc=$? t=$SECONDS"; tail -1 $OUT/gpu-tests-int4.txt; }
