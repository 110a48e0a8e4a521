#!/bin/bash
# 0.6B single stream at main: fresh one-row GEMV choices, then with 95fb9b7's choices written into the file.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TIDAL_BENCH_DATE=2026-12-01 TIDAL_COMMIT=$(cat COMMIT)
show() {
  python3 -c "
import json; d=json.load(open('$OUT/ab06c-$1.json')); s=d.get('single_stream',{}); b=s.get('best',{}); g=d.get('decode_step_gpu',{})
print('$1', round(s.get('output_tok_s_median',0),1), 'graph_s', b.get('graph_replay_gpu_s'), {k: round(v.get('gpu_ms',0),4) for k,v in g.items() if isinstance(v,dict) and 'gpu_ms' in v}, d.get('startup',{}).get('one_row_linear_choice'))" 2>&1 | tail -2
}
F=$(find / -path /proc -prune -o -type d -name gemv -path "*tidal*" -print 2>/dev/null | head -5); echo "choice dirs: $F"
for d in $F; do rm -rf $d; done
timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --skip single_stream_eager,single_stream_sync_scheduling,single_stream_no_gemv,single_stream_graphs_no_fused_kernels --out $OUT/ab06c-fresh.json > /tmp/c1.log 2>&1; echo "fresh rc=$? t=$SECONDS"; show fresh
J=$(find / -path /proc -prune -o -type f -path "*tidal*/gemv/*.json" -print 2>/dev/null | head -3); echo "files: $J"
for j in $J; do python3 - "$j" <<'PY'
import json, sys
p = sys.argv[1]; d = json.load(open(p))
old = {"6144x1024": {"block_n": 2, "block_k": 1024, "num_warps": 4}, "151936x1024": None,
       "1024x3072": {"block_n": 2, "block_k": 1024, "num_warps": 4}, "1024x2048": {"block_n": 2, "block_k": 1024, "num_warps": 4},
       "4096x1024": {"block_n": 2, "block_k": 512, "num_warps": 4}}
for key in list(d):
    shape = key.split(":")[0]
    if shape in old:
        d[key] = old[shape]
json.dump(d, open(p, "w")); print("rewrote", p, d)
PY
done
timeout 100 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite smoke --skip single_stream_eager,single_stream_sync_scheduling,single_stream_no_gemv,single_stream_graphs_no_fused_kernels --out $OUT/ab06c-oldchoices.json > /tmp/c2.log 2>&1; echo "oldchoices rc=$? t=$SECONDS"; show oldchoices
