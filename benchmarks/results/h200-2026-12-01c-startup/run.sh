#!/bin/bash
# The device run behind this folder (issue 22, 2026-12-01, fourth session): memory_bench in the
# environment our image gives (transformers 5.24 from .whl-tf, bytecode written once, as
# h200-2026-12-01b-startup did it), then the GPU tests of the CUDA graphs and sleep mode.
# Run from the repository copy's root with OUT set and COMMIT the commit under test.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site2 "$WHL_TF"/*.whl || exit 1
export PYTHONPATH=$PWD/engine:$PWD/operator:/tmp/site2:/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
python3 -c "import torch, triton, transformers; from transformers import AutoTokenizer, PreTrainedTokenizerFast; import tidal_engine.entrypoints.llm"
TIDAL_COMMIT=$COMMIT TIDAL_BENCH_DATE=2026-12-01 python3 benchmarks/memory_bench.py all --out "$OUT/mem" \
    --stages write,engine,construct,cold_plain,construct_tokfirst,profile --stage-timeout 100 > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E '^=== |"construct_s"' "$OUT/bench.log" | cut -c1-400
timeout 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graphs.py > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu-tests.log"
tail -5 "$OUT/gpu-tests.log"
