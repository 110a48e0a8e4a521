#!/bin/bash
# fp8w's one device call (issue 15, FP8 single stream): graph test of the new launch kinds, the
# fp8 and bf16 single-stream benches, then every FP8 GPU test. Each step its own process, bounded.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export TIDAL_COMMIT=04629c7 TIDAL_BENCH_DATE=2026-12-01 TIDAL_BENCH_LOG=INFO
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_quantization_kernels.py"
timeout 50 $PYT -k "split_k_and_pdl" > $OUT/gpu-tests-graph.txt 2>&1; rc=$?; echo "graph tests rc=$rc t=$SECONDS"; tail -4 $OUT/gpu-tests-graph.txt
if [ $rc -ne 0 ]; then sed -i '/Fp8GemvConfig(.*pdl=[12])/d' engine/tidal_engine/kernels/triton/quant_fp8.py; echo "pdl candidates removed for the benches"; fi
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
echo "=== [$SECONDS s] quant fp8" > $OUT/bench-log.txt
timeout 80 $B --quantization fp8 --out $OUT/quant-qwen3-8b-fp8.json >> $OUT/bench-log.txt 2>&1; echo "fp8 rc=$? t=$SECONDS"
echo "=== [$SECONDS s] quant none" >> $OUT/bench-log.txt
timeout 45 $B --quantization none --out $OUT/quant-qwen3-8b-none.json >> $OUT/bench-log.txt 2>&1; echo "none rc=$? t=$SECONDS"
python3 -c "
import json,glob,os
for f in sorted(glob.glob(os.environ['OUT']+'/*.json')):
    for k,v in json.load(open(f)).items():
        if k.startswith('quant_') and isinstance(v,dict):
            s=v.get('single_stream',{}); print(k, s.get('output_tok_s_median'), s.get('decode_tok_s_median'), str(v.get('error',''))[:300])
"
grep -E "row fp8 linear [0-9]+x[0-9]+|one-row linear|not used|Error|error" $OUT/bench-log.txt | sed -E 's/Fp8GemvConfig\(block_n=([0-9]+), block_k=([0-9]+), num_warps=([0-9]+), num_stages=([0-9]+), split_k=([0-9]+), pdl=([0-9]+)\)/\1,\2,\3,\4,s\5,p\6/g' | cut -c1-1200
R=$((236-SECONDS)); [ $R -gt 20 ] && { timeout $R $PYT -k "(fp8 or activation) and not split_k_and_pdl" > $OUT/gpu-tests.txt 2>&1; echo "tests rc=$? t=$SECONDS"; tail -6 $OUT/gpu-tests.txt; }
