#!/bin/bash
# Lead's second device call (2026-12-02, tenth session), issue 15: split-KV decode attention whose empty
# splits leave before the PDL wait (TIDAL_EXP_EARLY=1, an experiment), alone and in the GPTQ single stream.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== micro $(date +%T)"
timeout 100 python3 benchmarks/decode_parts_micro.py --parts attention --out "$OUT/attention-early.json" 2>&1 | tail -5
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed,decode_gpu --quantization gptq"
for run in a:0 b:1 c:0 d:1; do
  name=${run%%:*}; early=${run#*:}
  echo "=== $name early=$early $(date +%T)"
  TIDAL_EXP_EARLY=$early timeout 100 $B --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
  grep -E "Traceback|Error" /tmp/bench-log-$name.txt | tail -3
  python3 - "$OUT/quant-$name.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith("quant_") and isinstance(v, dict):
        ss = v.get("single_stream", {})
        print(k, "single", round(ss.get("output_tok_s_median", 0), 1), "decode", round(ss.get("decode_tok_s_median", 0), 1),
              "ttft", round(ss.get("best", {}).get("ttft_s", 0) * 1e3, 2))
P
done
echo "=== end $(date +%T)"
