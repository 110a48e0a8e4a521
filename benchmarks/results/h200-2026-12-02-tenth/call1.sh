#!/bin/bash
# Lead's first device call (2026-12-02, tenth session), issue 15: where the INT4 single stream's last
# 2% could come from. From .dev/main (a copy of the tree at COMMIT): the one-row INT4 GEMV over
# activations paired ahead against the engine's, paged attention's split counts at one sequence, and
# what the GPU runs between two decode graphs of the GPTQ single stream.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=2026-12-02 TRITON_INTERPRET=0 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
echo "=== micro $(date +%T)"
timeout 200 python3 benchmarks/decode_parts_micro.py --out "$OUT/decode-parts.json" 2>&1 | tail -20
echo "=== timeline $(date +%T)"
timeout 150 python3 benchmarks/single_stream_timeline.py --shape qwen3-8b --quantization gptq \
  --out "$OUT/timeline-gptq.json" > /tmp/timeline-log.txt 2>&1; echo "rc $?"
grep -vE "^\s*$" /tmp/timeline-log.txt | grep -v Warning | tail -25
cp /tmp/timeline-log.txt "$OUT/timeline-log.txt"
echo "=== end $(date +%T)"
