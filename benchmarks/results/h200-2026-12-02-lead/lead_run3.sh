#!/bin/bash
# Lead's third device call (2026-12-02, eighth session), issue 13: as call 2 (lead_run2.sh), on 9716a08: the one-row
# candidates timed interleaved (fastest of 5 rounds), alone and in the step; a gate|up weight as the step runs it. GPU tests of
# test_gemv; the 8B single stream three times and the 0.6B once, fresh choices each (the one-row log lines kept);
# the 8B cold/warm start as call 1.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-02 TIDAL_BENCH_LOG=info
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_gemv.py > $OUT/gpu-tests.txt 2>&1
echo "gpu tests rc=$? t=$SECONDS"; tail -2 $OUT/gpu-tests.txt
clear_choices() { for d in $(find / -path /proc -prune -o -type d -name gemv -path "*tidal*" -print 2>/dev/null); do rm -rf "$d"; done; }
show() {
  python3 -c "
import json; d=json.load(open('$1')); s=d.get('single_stream',{}); st=d.get('startup',{})
print('$1'.split('/')[-1], 'tok/s', round(s.get('output_tok_s_median',0),1), 'construct_s', round(st.get('llm_construct_s_first',0),2))
print('  choice', st.get('one_row_linear_choice'))
for k,v in (st.get('one_row_step_timings_s') or {}).items(): print('  in-step', k, {c: round(t*1e6,1) for c,t in v.items()})
g=d.get('decode_step_gpu',{}); print('  step gpu ms', {k: round(v.get('gpu_ms',0),4) for k,v in g.items() if isinstance(v,dict) and 'gpu_ms' in v})" 2>&1 | tail -14
}
SKIP=single_stream_eager,single_stream_sync_scheduling,single_stream_no_gemv,single_stream_graphs_no_fused_kernels
for run in fresh1 fresh2 fresh3; do
  clear_choices
  timeout 120 python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite smoke --skip $SKIP --out $OUT/smoke-8b-$run.json > /tmp/s8-$run.log 2>&1
  echo "8B $run rc=$? t=$SECONDS"; show $OUT/smoke-8b-$run.json
  { echo "== $run"; grep -E "linear [0-9]+x[0-9]+|in the decode step" /tmp/s8-$run.log | cut -c1-400; } >> $OUT/one-row-8b.txt
done
clear_choices
timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --skip $SKIP --out $OUT/smoke-06b-fresh1.json > /tmp/s06.log 2>&1
echo "0.6B fresh1 rc=$? t=$SECONDS"; show $OUT/smoke-06b-fresh1.json
clear_choices
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site2 ../../.whl-tf/*.whl || exit 1
mkdir -p $OUT/startup
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site2:/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
python3 -c "import torch, triton, transformers; from transformers import AutoTokenizer, PreTrainedTokenizerFast; import tidal_engine.entrypoints.llm"
timeout 200 python3 benchmarks/memory_bench.py all --out $OUT/startup --stages write,engine,construct,construct --stage-timeout 80 > $OUT/startup/bench.log 2>&1
echo "startup rc=$? t=$SECONDS"; grep -E '^=== |"construct_s"|one_row_linear_choice' $OUT/startup/bench.log | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/startup/memory-qwen3-8b.json'))
for k in ('engine','construct','construct_3'):
    v=d.get(k,{}); print(k, round(v.get('construct_s',0),2), {a: round(b,3) for a,b in (v.get('startup_seconds') or {}).items()})"
