#!/bin/bash
# Lead's seventh device call (2026-12-02, tenth session), issue 15: call 6's sweep winners added to the
# start-up candidates (PackedGemvConfig(16, 512, 2, 2), (16, 2048, 4, 2)). gpu_bench --suite quant: GPTQ
# twice, AWQ once.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for run in a:gptq b:awq c:gptq; do
  IFS=: read name quant <<< "$run"
  echo "=== $name $quant $(date +%T)"
  timeout 110 $B --quantization $quant --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
  grep -E "Traceback|Error" /tmp/bench-log-$name.txt | tail -3
  python3 - "$OUT/quant-$name.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("quant_") and isinstance(v, dict):
        ss, dg = v.get("single_stream", {}), v.get("decode_gpu", {})
        print(k, "single", round(ss.get("output_tok_s_median", 0), 1), "decode", round(ss.get("decode_tok_s_median", 0), 1),
              "ttft", round(ss.get("best", {}).get("ttft_s", 0) * 1e3, 2), "graph b1", dg.get("b1_ctx256", {}).get("gpu_ms"),
              "construct", round(v.get("llm_construct_s", 0), 1))
        print("  ", {n: r["one_row"] for n, r in v.get("one_row_kernels", {}).items()})
P
done
echo "=== end $(date +%T)"
