#!/bin/bash
# Lead's second device call (2026-12-01, fourth session): start-up of main 8af5b67 (few-row GEMV
# timing only with speculative decoding), in our image's environment as h200-2026-12-01c-startup.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site2 ../../.whl-tf/*.whl || exit 1
mkdir -p $OUT/startup
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site2:/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
python3 -c "import torch, triton, transformers; from transformers import AutoTokenizer, PreTrainedTokenizerFast; import tidal_engine.entrypoints.llm"
TIDAL_COMMIT=8af5b67 TIDAL_BENCH_DATE=2026-12-01 timeout 230 python3 benchmarks/memory_bench.py all --out $OUT/startup     --stages write,engine,construct,construct --stage-timeout 80 > $OUT/startup/bench.log 2>&1
echo "startup rc=$?"; grep -E '^=== |"construct_s"' $OUT/startup/bench.log | cut -c1-200
