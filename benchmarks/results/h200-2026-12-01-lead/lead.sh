#!/bin/bash
# Lead's H200 call of 2026-12-01 (session 4): GPU tests left unrun, start-up at HEAD, 0.6B A/B.
export TIDAL_BENCH_DATE=2026-12-01 PYTHONPYCACHEPREFIX=/tmp/pyc TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu_tests.log
# 1. GPU tests never run compiled: offload streams (3 cases) and the staged upload.
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kv_offload.py tests/engine/test_loader.py -k "cuda_streams or staged_uploads" >> $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?" >> $OUT/gpu_tests.log
# 2. 0.6B offline suite: HEAD vs 8543343 (the 2026-11-30 measured commit), same machine.
TIDAL_COMMIT=$HEAD_SHA timeout 150 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite sampled --models /tmp/bm --out $OUT/ab-head-0.6b.json > $OUT/ab.log 2>&1
echo "head rc=$?" >> $OUT/ab.log
(cd .dev/old && export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site && TIDAL_COMMIT=8543343 timeout 150 python3 benchmarks/gpu_bench.py --shape qwen3-0.6b --suite sampled --models /tmp/bm --out $OUT/ab-old-0.6b.json >> $OUT/ab.log 2>&1; echo "old rc=$?" >> $OUT/ab.log)
# 3. Start-up and sleep/wake of HEAD: cold (empty cache dir) and warm construction.
TIDAL_COMMIT=$HEAD_SHA timeout 230 python3 benchmarks/memory_bench.py all --out /tmp/mem --stages write,engine,construct --stage-timeout 110 > $OUT/mem-log.txt 2>&1
echo "mem rc=$?" >> $OUT/mem-log.txt
cp /tmp/mem/memory-*.json $OUT/ 2>/dev/null; ls /tmp/mem >> $OUT/mem-log.txt
