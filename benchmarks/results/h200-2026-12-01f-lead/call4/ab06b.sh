#!/bin/bash
# A/B of the 0.6B single stream on one machine: main (this tree) against 95fb9b7 (946 tok/s on 2026-12-01).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TIDAL_BENCH_DATE=2026-12-01
one() {  # $1 label, $2 tree
  ( cd $2 && export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TIDAL_COMMIT=$(cat COMMIT) &&
    timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --out $OUT/ab06b-$1.json > /tmp/ab-$1.log 2>&1 )
  echo "$1 rc=$? t=$SECONDS"
  python3 -c "
import json; d=json.load(open('$OUT/ab06b-$1.json')); s=d.get('single_stream',{}); b=s.get('best',{}); g=d.get('decode_step_gpu',{})
print('$1', round(s.get('output_tok_s_median',0),1), 'graph_s', b.get('graph_replay_gpu_s'), 'exec_s', b.get('runner_execute_s'), {k: round(v.get('gpu_ms',0),4) for k,v in g.items() if isinstance(v,dict) and 'gpu_ms' in v})" 2>&1 | tail -2
}
one old ../old
one head .
one old2 ../old
