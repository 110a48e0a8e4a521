#!/bin/bash
# Lead's fourth device call (2026-12-02, ninth session), issue 15: the packed INT4 GEMV loads two steps of
# weights before its PDL wait (the first step peeled off). From .dev/main (a copy of the tree at COMMIT): the PDL chain test and
# the packed INT4 gpu tests, then gpu_bench --suite quant for GPTQ in two processes and AWQ.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1 TIDAL_BENCH_LOG=INFO
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu"
echo "=== tests $(date +%T)"
timeout 90 $PYT tests/engine/test_pdl.py tests/engine/test_quant_int4_packed.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/gpu-tests.txt"; tail -1 "$OUT/gpu-tests.txt"
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for run in a:gptq b:gptq c:awq; do
  name=${run%%:*}; quants=${run#*:}
  echo "=== $name $quants $(date +%T)"
  timeout 100 $B --quantization $quants --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
  grep -E "Traceback|Error" /tmp/bench-log-$name.txt | tail -3
  python3 - "$OUT/quant-$name.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("quant_") and isinstance(v, dict):
        ss, dg = v.get("single_stream", {}), v.get("decode_gpu", {})
        print(k, "single", round(ss.get("output_tok_s_median", 0), 1), "decode", round(ss.get("decode_tok_s_median", 0), 1),
              "ttft", round(ss.get("best", {}).get("ttft_s", 0) * 1e3, 2), "graph b1", dg.get("b1_ctx256", {}).get("gpu_ms"))
P
done
cat /tmp/bench-log-*.txt > "$OUT/bench-log.txt"
echo "=== end $(date +%T)"
