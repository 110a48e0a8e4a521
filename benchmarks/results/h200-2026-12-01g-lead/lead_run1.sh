#!/bin/bash
# Lead's first device call (2026-12-01, seventh session), issue 13: the one-row GEMV tiles of small
# weights chosen inside the batch-1 decode step (5db5b7a). GPU tests, the 0.6B single stream with
# fresh choices twice and with the stored ones, the 8B single stream, then served 0.6B.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat COMMIT); export TIDAL_COMMIT=$C TIDAL_BENCH_DATE=2026-12-01
nvidia-smi -L
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_gemv.py > $OUT/gpu-tests.txt 2>&1
echo "gpu tests rc=$? t=$SECONDS"; tail -2 $OUT/gpu-tests.txt
clear_choices() { for d in $(find / -path /proc -prune -o -type d -name gemv -path "*tidal*" -print 2>/dev/null); do rm -rf "$d"; done; }
show() {
  python3 -c "
import json; d=json.load(open('$1')); s=d.get('single_stream',{}); st=d.get('startup',{})
print('$1'.split('/')[-1], 'tok/s', round(s.get('output_tok_s_median',0),1), 'construct_s', round(st.get('llm_construct_s_first',0),2))
print('  choice', st.get('one_row_linear_choice'))
for k,v in (st.get('one_row_step_timings_s') or {}).items(): print('  in-step', k, {c: round(t*1e6,1) for c,t in v.items()})
g=d.get('decode_step_gpu',{}); print('  step gpu ms', {k: round(v.get('gpu_ms',0),4) for k,v in g.items() if isinstance(v,dict) and 'gpu_ms' in v})" 2>&1 | tail -12
}
SKIP=single_stream_eager,single_stream_sync_scheduling,single_stream_no_gemv,single_stream_graphs_no_fused_kernels
for run in fresh1 fresh2 stored; do
  [ $run != stored ] && clear_choices
  timeout 120 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --skip $SKIP --out $OUT/smoke-0.6b-$run.json > /tmp/s-$run.log 2>&1
  echo "0.6B $run rc=$? t=$SECONDS"; show $OUT/smoke-0.6b-$run.json
done
timeout 150 python3 benchmarks/gpu_bench.py --shape qwen3-8b --suite smoke --skip $SKIP --out $OUT/smoke-8b.json > /tmp/s-8b.log 2>&1
echo "8B rc=$? t=$SECONDS"; show $OUT/smoke-8b.json
mkdir -p $OUT/serve
OUT=$OUT/serve MODELS=qwen3-0.6b WORKLOADS="greedy sampled" T_BENCH=120 WHEELS= bash benchmarks/run_serve_h200.sh > /dev/null 2>&1
echo "serve 0.6B rc=$? t=$SECONDS"; grep -E "^ +256 +512|out tok/s|TPOT" $OUT/serve/run_serve.log | head -12
rm -f $OUT/serve/server-qwen3-0.6b.log.gz
