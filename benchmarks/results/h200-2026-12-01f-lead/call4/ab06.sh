#!/bin/bash
# A/B of the 0.6B single stream: main against main with the paged attention of two earlier commits.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
PA=engine/tidal_engine/kernels/triton/paged_attention.py
cp $PA /tmp/pa_head.py
one() {  # $1 label
  timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --out $OUT/ab06-$1.json > /tmp/ab06-$1.log 2>&1
  echo "$1 rc=$? t=$SECONDS"
  python3 -c "
import json; d=json.load(open('$OUT/ab06-$1.json')); s=d.get('single_stream',{}); b=s.get('best',{}); g=d.get('decode_step_gpu',{})
print('$1', round(s.get('output_tok_s_median',0),1), 'graph_s', b.get('graph_replay_gpu_s'), 'exec_s', b.get('runner_execute_s'), str(g)[:300])" 2>&1 | tail -2
}
one head
cp pa_before_43e30a6.py $PA; one before43e30a6
cp pa_before_84be1a1.py $PA; one before84be1a1
cp /tmp/pa_head.py $PA; one head2
