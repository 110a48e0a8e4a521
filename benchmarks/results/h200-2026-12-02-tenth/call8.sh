#!/bin/bash
# Lead's eighth device call (2026-12-02, tenth session), issue 15: the packed INT4 GEMV's gpu tests with call 7's
# candidates (every packed candidate against the emulation and the reference, folded SiLU, CUDA graphs).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../../.whl/*.whl || exit 1
export PYTHONPATH=engine:operator:/tmp/site TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/engine/test_quant_int4_packed.py \
  tests/engine/test_pdl.py > "$OUT/gpu-tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/gpu-tests.txt"; tail -3 "$OUT/gpu-tests.txt"
