#!/bin/bash
# Lead's first device call (2026-12-01, sixth session): the offline step timeline (issue 13) and
# the tinygemm INT4 probe (issue 15).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
timeout 90 python3 benchmarks/int4_tinygemm_probe.py --out $OUT/int4_tinygemm_probe.json > $OUT/tinygemm-log.txt 2>&1
echo "tinygemm rc=$? t=$SECONDS"; cat $OUT/tinygemm-log.txt | tail -14
timeout 240 python3 benchmarks/step_timeline.py --shape qwen3-8b --out $OUT/step_timeline.json > $OUT/timeline-log.txt 2>&1
echo "timeline rc=$? t=$SECONDS"; tail -5 $OUT/timeline-log.txt
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/step_timeline.json"))
for k in ("sampler_micro_greedy", "sampler_micro_sampled"):
    print(k, d.get(k))
for k in ("greedy_warm", "sampled", "greedy", "sampled_again"):
    r = d.get(k, {})
    print(k, round(r.get("output_tok_s", 0)), r.get("steps"), round(r.get("elapsed_s", 0), 3), r.get("error"))
    t = r.get("timeline", {})
    for part in ("decode", "other"):
        p = t.get(part, {})
        if p:
            print("   ", part, p["steps"], {x: {y: round(v, 3) for y, v in p[x].items()} for x in ("gap_before_ms", "forward_ms", "after_forward_ms")})
PY
