#!/bin/bash
# Lead's second device call: sampled_host_diag with fresh prompts per run and Triton compile counts.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
timeout 200 python3 benchmarks/sampled_host_diag.py --shape qwen3-8b --out $OUT/sampled_host_diag2.json > $OUT/diag2-log.txt 2>&1
echo "diag rc=$? t=$SECONDS"
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sampled_host_diag2.json"))
print("compiles at start", d.get("triton_compiles_at_start"))
for k in ("sampled_first", "greedy", "sampled_second", "greedy_second", "sampled_profiled"):
    r = d.get(k, {})
    tc = r.get("triton_compiles", {})
    print(k, round(r.get("output_tok_s", 0)), r.get("steps"), round(r.get("runner_execute_s", 0), 3), r.get("allocator_delta"), tc.get("count"), round(tc.get("seconds", 0), 3))
    for name, sec in tc.get("kernels", [])[:12]:
        print("   ", round(sec or 0, 3), name[:150])
PY
