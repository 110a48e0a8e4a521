#!/bin/bash
# Lead's fourth device call (2026-12-02, tenth session), issue 15: the folded residual norm with the residual
# rows and the first steps' activations loaded before the statistic, and the greedy argmax kernel (helper
# argmax). From .dev/main (a copy of the tree at COMMIT): their gpu tests, argmax_micro, the single-stream
# timeline, gpu_bench --suite quant GPTQ with TIDAL_FOLD_NORMS=1, 0, 1.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_argmax.py \
  tests/engine/test_quant_int4_packed.py -k "argmax or residual or folded or sampler" > "$OUT/gpu-tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/gpu-tests.txt"; tail -3 "$OUT/gpu-tests.txt"
echo "=== argmax micro $(date +%T)"
timeout 90 python3 benchmarks/argmax_micro.py --out "$OUT/argmax-micro.json" 2>&1 | grep -vE "Warning|warn" | tail -12
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for run in a:1 b:0 c:1; do
  IFS=: read name fold <<< "$run"
  echo "=== $name gptq fold=$fold $(date +%T)"
  TIDAL_FOLD_NORMS=$fold timeout 100 $B --quantization gptq --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
  grep -E "Traceback|Error" /tmp/bench-log-$name.txt | tail -3
  python3 - "$OUT/quant-$name.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("quant_") and isinstance(v, dict):
        ss, dg = v.get("single_stream", {}), v.get("decode_gpu", {})
        print(k, "single", round(ss.get("output_tok_s_median", 0), 1), "decode", round(ss.get("decode_tok_s_median", 0), 1),
              "ttft", round(ss.get("best", {}).get("ttft_s", 0) * 1e3, 2), "graph b1", dg.get("b1_ctx256", {}).get("gpu_ms"))
        print("  eager top", [(r["kernel"][:24], r["calls"], r["total_us"]) for r in dg.get("eager_kernels_b1_ctx256", [])[:6]])
P
done
echo "=== timeline $(date +%T)"
timeout 100 python3 benchmarks/single_stream_timeline.py --shape qwen3-8b --quantization gptq \
  --out "$OUT/timeline-gptq.json" 2>&1 | grep -vE "Warning|warn|^\s*$" | tail -12
echo "=== end $(date +%T)"
