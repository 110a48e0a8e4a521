#!/bin/bash
# Lead's sixth device call (2026-12-02, tenth session), issue 15: a decode graph's inputs staged by one
# kernel (graph_inputs.py) and the greedy argmax recording the sampled ids itself; then the one-row packed
# INT4 tiles swept under PDL (int4_micro.py --rows 1 --sweep). From .dev/main (a copy of main at COMMIT):
# the CUDA-graph, argmax and staging gpu tests, gpu_bench --suite quant GPTQ twice, the single-stream
# timeline, the sweep.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_cuda_graphs.py \
  tests/engine/test_argmax.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/gpu-tests.txt"; tail -3 "$OUT/gpu-tests.txt"
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for name in a b; do
  echo "=== $name gptq $(date +%T)"
  timeout 100 $B --quantization gptq --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
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
echo "=== timeline $(date +%T)"
timeout 80 python3 benchmarks/single_stream_timeline.py --shape qwen3-8b --quantization gptq \
  --out "$OUT/timeline-gptq.json" 2>&1 | grep -vE "Warning|warn|^\s*$" | tail -11
echo "=== sweep $(date +%T)"
timeout 200 python3 benchmarks/int4_micro.py --rows 1 --sweep --out "$OUT/int4-micro-sweep.json" > /tmp/sweep-log.txt 2>&1
echo "rc $?"; grep -E "WRONG|failed|Error" /tmp/sweep-log.txt | tail -5
python3 - "$OUT/int4-micro-sweep.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
for shape, row in d.items():
    t = sorted((v, k[len("gemv_r1_"):-3]) for k, v in row.items() if k.startswith("gemv_r1_") and k.endswith("_us") and v == v)
    print(shape, [(round(v, 2), k) for v, k in t[:5]])
    f = sorted((v, k[len("folded_r1_"):-3]) for k, v in row.items() if k.startswith("folded_r1_") and k.endswith("_us") and v == v)
    if f:
        print("  folded", [(round(v, 2), k) for v, k in f[:5]])
P
echo "=== end $(date +%T)"
