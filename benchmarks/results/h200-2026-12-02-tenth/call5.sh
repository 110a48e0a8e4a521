#!/bin/bash
# Lead's fifth device call (2026-12-02, tenth session), issue 15: the one-row packed INT4 GEMV's tiles swept
# again now that the kernels launch with programmatic dependent launch (int4_micro.py --rows 1 --sweep).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== sweep $(date +%T)"
timeout 400 python3 benchmarks/int4_micro.py --rows 1 --sweep --out "$OUT/int4-micro-sweep.json" > /tmp/sweep-log.txt 2>&1
echo "rc $?"; grep -vE "Warning|warn|^\s*$" /tmp/sweep-log.txt | grep -E "rows 1|WRONG|failed|Error" | tail -12
cp /tmp/sweep-log.txt "$OUT/sweep-log.txt"
python3 - "$OUT/int4-micro-sweep.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
for shape, row in d.items():
    t = sorted((v, k[len("gemv_r1_"):-3]) for k, v in row.items() if k.startswith("gemv_r1_") and k.endswith("_us") and v == v)
    print(shape, [(round(v, 2), k) for v, k in t[:6]])
    f = sorted((v, k[len("folded_r1_"):-3]) for k, v in row.items() if k.startswith("folded_r1_") and k.endswith("_us") and v == v)
    if f:
        print("  folded", [(round(v, 2), k) for v, k in f[:6]])
P
echo "=== end $(date +%T)"
