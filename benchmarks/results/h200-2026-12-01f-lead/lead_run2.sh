#!/bin/bash
# Lead's second device call (2026-12-01, sixth session): the offline step timeline again with the
# heap frozen after the build, then the served 8B load (greedy, sampled) and the offline sampled suite.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
timeout 200 python3 benchmarks/step_timeline.py --shape qwen3-8b --out $OUT/step_timeline2.json > $OUT/timeline2-log.txt 2>&1
echo "timeline rc=$? t=$SECONDS"; tail -3 $OUT/timeline2-log.txt
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/step_timeline2.json"))
for k in ("greedy_warm", "sampled", "greedy", "sampled_again"):
    r = d.get(k, {})
    print(k, round(r.get("output_tok_s", 0)), r.get("steps"), round(r.get("elapsed_s", 0), 3), r.get("error"), r.get("collector"))
    t = r.get("timeline", {})
    for part in ("decode", "other"):
        p = t.get(part, {})
        if p:
            print("   ", part, p["steps"], {x: {y: round(v, 3) for y, v in p[x].items()} for x in ("gap_before_ms", "forward_ms", "after_forward_ms")})
PY
MODELS=qwen3-8b WORKLOADS="greedy sampled" OFFLINE=1 T_BENCH=150 bash benchmarks/run_serve_h200.sh > /dev/null 2>&1
echo "serve rc=$? t=$SECONDS"
grep -E "out tok/s|output_tok_s|TPOT|tok/s" $OUT/run_serve.log | tail -12
