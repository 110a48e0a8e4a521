#!/bin/bash
# Lead's third device call (2026-12-01, sixth session), issue 13: served 8B with both processes'
# heaps frozen (one API server, then two), the 512-prompt admission pattern offline, single streams.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
BASE=$OUT
OUT=$BASE MODELS=qwen3-8b WORKLOADS="greedy sampled" T_BENCH=120 bash benchmarks/run_serve_h200.sh > /dev/null 2>&1
echo "serve rc=$? t=$SECONDS"; grep -E "^ +256 +512" $BASE/run_serve.log
mkdir -p $BASE/api2
OUT=$BASE/api2 MODELS=qwen3-8b WORKLOADS="greedy" SERVER_FLAGS="--api-server-count 2" T_BENCH=120 bash benchmarks/run_serve_h200.sh > /dev/null 2>&1
echo "serve api2 rc=$? t=$SECONDS"; grep -E "^ +256 +512" $BASE/api2/run_serve.log
tail -5 $BASE/api2/server-qwen3-8b.log; rm -f $BASE/api2/server-qwen3-8b.log $BASE/api2/run_serve.log  # at most 8 files come back
timeout 120 python3 benchmarks/step_timeline.py --shape qwen3-8b --no-micro --runs greedy_warm,greedy_512_prompts --out $BASE/step_timeline3.json > /tmp/timeline3-log.txt 2>&1
echo "timeline rc=$? t=$SECONDS"; tail -2 /tmp/timeline3-log.txt
python3 -c "
import json,sys
d=json.load(open('$BASE/step_timeline3.json'))
for k in ('greedy_warm','greedy_512_prompts'):
    r=d.get(k,{}); print(k, round(r.get('output_tok_s',0)), r.get('steps'), round(r.get('elapsed_s',0),3), r.get('error'), r.get('collector'))
    t=r.get('timeline',{})
    for part in ('decode','other'):
        p=t.get(part,{})
        if p: print('   ',part,p['steps'],{x:{y:round(v,3) for y,v in p[x].items()} for x in ('gap_before_ms','forward_ms','after_forward_ms')})
"
for shape in qwen3-8b qwen3-0.6b; do
  timeout 150 python3 benchmarks/gpu_bench.py --shape $shape --suite smoke --out $BASE/smoke-$shape.json > /dev/null 2>&1
  echo "smoke $shape rc=$? t=$SECONDS"
  python3 -c "
import json; r=json.load(open('$BASE/smoke-$shape.json')).get('single_stream',{}); print({k:v for k,v in r.items() if k!='runs'})"
done
