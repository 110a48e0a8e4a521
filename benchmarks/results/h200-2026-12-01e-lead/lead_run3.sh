#!/bin/bash
# Lead's third device call: where a sampled run's host time goes (cProfile), against greedy.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
timeout 200 python3 benchmarks/sampled_host_diag.py --shape qwen3-8b --cprofile --out $OUT/cprof.json > $OUT/cprof-log.txt 2>&1
echo "diag rc=$? t=$SECONDS"
grep -E '^--- |output_tok_s' $OUT/cprof-log.txt | cut -c1-300
head -60 $OUT/cprof_sampled_cprofile.txt
