#!/bin/bash
# Lead's device call (2026-12-02, ninth session), issue 15: programmatic dependent launch (PDL) in the decode
# step. From .dev/main (a copy of the tree at COMMIT): the PDL chain test, gpu_bench --suite quant (single
# stream, the captured step's GPU time and one eager step's kernels) for bf16, FP8 and GPTQ with PDL, then bf16
# and GPTQ with TIDAL_PDL=0 (same choices: the second process finds the first one's stored ones); then the
# gpu tests of the files PDL touched.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1 TIDAL_BENCH_LOG=INFO
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu"
echo "=== pdl test $(date +%T)"
timeout 60 $PYT tests/engine/test_pdl.py > "$OUT/gpu-tests.txt" 2>&1; echo "rc $?" | tee -a "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for run in pdl:none,fp8,gptq nopdl:none,gptq; do
  name=${run%%:*}; quants=${run#*:}
  echo "=== $name $quants $(date +%T)"
  if [ $name = nopdl ]; then export TIDAL_PDL=0; fi
  timeout 170 $B --quantization $quants --out "$OUT/quant-$name.json" > "$OUT/bench-log-$name.txt" 2>&1; echo "rc $?"
  grep -E "Traceback|Error" "$OUT/bench-log-$name.txt" | tail -3
  python3 - "$OUT/quant-$name.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("quant_") and isinstance(v, dict):
        ss, dg = v.get("single_stream", {}), v.get("decode_gpu", {})
        print(k, "single", round(ss.get("output_tok_s_median", 0), 1), "decode", round(ss.get("decode_tok_s_median", 0), 1),
              "graph b1", dg.get("b1_ctx256", {}).get("gpu_ms"), "eager sum b1", dg.get("eager_kernel_total_us_b1_ctx256"))
P
done
unset TIDAL_PDL
echo "=== gpu tests $(date +%T)"
timeout 150 $PYT tests/engine/test_gemv.py tests/engine/test_cuda_graphs.py tests/engine/test_qkv_prologue.py \
  tests/engine/test_quant_int4_packed.py >> "$OUT/gpu-tests.txt" 2>&1; echo "rc $?" | tee -a "$OUT/gpu-tests.txt"
grep -E "passed|failed|FAILED" "$OUT/gpu-tests.txt" | tail -8
echo "=== end $(date +%T)"
