#!/usr/bin/env bash
# The one device call of h200-2026-12-02-kvfp8u, from the repository root (see README.md).
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { local l=$(( ${BUDGET:-280} - $(el) )); echo $(( l > 1 ? l : 1 )); }
export TIDAL_COMMIT=$(cat COMMIT) TIDAL_BENCH_DATE=$(date -u +%F) TRITON_CACHE_DIR=/tmp/tc TRITON_INTERPRET=0
LOG=$OUT/log.txt
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $LOG
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu"
(timeout 140 $PYT tests/engine/test_kv_fp8_kernels.py > /tmp/t1.txt 2>&1; echo "rc=$?" >> /tmp/t1.txt) &
(timeout 140 $PYT tests/engine/test_split_kv_attention.py > /tmp/t2.txt 2>&1; echo "rc=$?" >> /tmp/t2.txt) &
wait; cat /tmp/t1.txt /tmp/t2.txt > $OUT/gpu-tests.txt; echo "tests done at $(el) s" >> $LOG
B="python3 benchmarks/gpu_bench.py --shape qwen3-8b"
# The fp8 step at the engine's default (rows_bt), then the kernel alone: every preset and two more.
SETTINGS=$(python3 -c "
import sys; sys.path.insert(0, 'engine')
from tidal_engine.kernels.triton.paged_attention import FP8_DECODE_PRESETS
print(','.join(['preset_' + p for p in FP8_DECODE_PRESETS] + ['bt_ahead_block_n64_s3_r128_pf4', 'bt_ahead_block_n64_r128_pf2']))")
timeout $(left) $B --suite long-decode --kv-cache-dtype fp8 --skip attention_sweep_short \
    --attention-settings "$SETTINGS" --out $OUT/long-decode-fp8.json >> $LOG 2>&1
echo "fp8 rc=$? at $(el) s" >> $LOG
timeout $(left) $B --suite long-decode --kv-cache-dtype auto --skip attention_sweep,attention_sweep_short \
    --out $OUT/long-decode-auto.json >> $LOG 2>&1
echo "bf16 rc=$? at $(el) s" >> $LOG
# The captured step for the four candidate presets the kernel sweep ranked fastest.
TOP=$(python3 -c "
import json
s = json.load(open('$OUT/long-decode-fp8.json'))['long_decode_fp8']['attention_sweep']
c = {k[7:]: v['us'] for k, v in s.items() if k.startswith('preset_rows_bt_') and 'us' in v}
print(' '.join(sorted(c, key=c.get)[:4]))")
echo "steps for: $TOP" >> $LOG
for p in $TOP; do
  TIDAL_FP8_DECODE=$p timeout $(left) $B --suite long-decode --kv-cache-dtype fp8 \
      --skip attention_sweep,attention_sweep_short --out $OUT/long-decode-fp8-$p.json >> $LOG 2>&1
  echo "$p rc=$? at $(el) s" >> $LOG
done
tail -2 /tmp/t1.txt /tmp/t2.txt
grep -E "rc=|steps for|Error" $LOG | cut -c1-300
python3 -c "
import glob, json, os
for f in sorted(glob.glob('$OUT/long-decode-*.json')):
    for k, r in json.load(open(f)).items():
        if k.startswith('long_decode_') and isinstance(r, dict) and 'gpu_ms_median' in r:
            print(os.path.basename(f), k, round(r['gpu_ms_median'], 3), 'ms', r.get('kv_blocks'))
            for n, v in r.get('attention_sweep', {}).items():
                if isinstance(v, dict) and 'us' in v:
                    print('   ', n, round(v['us'], 1), 'us', round(v['read_TB_s'], 2), 'TB/s')
                elif isinstance(v, dict) and 'error' in v:
                    print('   ', n, v['error'][:200])
"
