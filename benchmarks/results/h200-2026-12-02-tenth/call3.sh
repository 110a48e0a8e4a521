#!/bin/bash
# Lead's third device call (2026-12-02, tenth session), issue 15: the residual norms folded into the one-row
# INT4 GEMVs (o_proj/down_proj add into the residual stream with its sums of squares, qkv/gate_up normalise it
# as they read it). From .dev/main (a copy of the tree at COMMIT): the packed INT4 and PDL gpu tests; greedy
# tokens with the folding on and off; gpu_bench --suite quant (GPTQ twice and AWQ folded, GPTQ with
# TIDAL_FOLD_NORMS=0).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_quant_int4_packed.py \
  tests/engine/test_pdl.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/gpu-tests.txt"; tail -3 "$OUT/gpu-tests.txt"
echo "=== tokens $(date +%T)"
for fold in 1 0; do
  TIDAL_FOLD_NORMS=$fold timeout 100 python3 - "$OUT/tokens-fold$fold.json" <<'P' 2>&1 | grep -vE "Warning|warn" | tail -2
import json, sys
sys.path.insert(0, "benchmarks")
import gpu_bench as gb
from pathlib import Path
folder = gb.quantized_config_folder("qwen3-8b", Path("/tmp/tidal-bench-models"), "gptq")
llm, _ = gb.make_llm(folder, load_format="dummy", skip_tokenizer_init=True)
prompts = gb.rand_prompts(3, [128, 40, 300], 7, gb.SHAPES["qwen3-8b"]["vocab_size"])
outs = [llm.generate([p], gb.greedy(48))[0].outputs[0].token_ids for p in prompts]  # one stream each: b = 1 graphs
json.dump([list(o) for o in outs], open(sys.argv[1], "w"))
print("tokens", [o[:8] for o in outs])
llm.engine.shutdown()
P
done
python3 - "$OUT/tokens-fold1.json" "$OUT/tokens-fold0.json" <<'P'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
for x, y in zip(a, b):
    same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    print("tokens equal for the first", same, "of", len(x))
P
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite quant --skip throughput_fixed"
for run in a:gptq:1 b:gptq:0 c:gptq:1 d:awq:1; do
  IFS=: read name quant fold <<< "$run"
  echo "=== $name $quant fold=$fold $(date +%T)"
  TIDAL_FOLD_NORMS=$fold timeout 100 $B --quantization $quant --out "$OUT/quant-$name.json" > /tmp/bench-log-$name.txt 2>&1; echo "rc $?"
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
cat /tmp/bench-log-*.txt | grep -vE "Warning|warn" | tail -40 > "$OUT/bench-log-tail.txt"
echo "=== end $(date +%T)"
