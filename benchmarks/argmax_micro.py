"""The greedy sampler's argmax on the GPU: torch.argmax against the split kernel argmax_rows.

For M = 1, 4, 64 and 256 rows of a Qwen3 vocabulary (151936) in fp32, and one bf16 row, times
``logits.argmax(dim=-1)`` and ``argmax_rows`` (its default chunk and a sweep of chunk sizes),
each as 32 calls captured in one CUDA graph (no launch overhead), cycling through a few logits
tensors (``time_in_graphs``: the candidates' graphs replay in turn, each keeps its fastest
replay). Every candidate's answer is first checked against torch's on every input. Prints one
line per shape; ``--out`` writes the JSON (with TIDAL_COMMIT / TIDAL_BENCH_DATE).

    PYTHONPATH=engine TRITON_INTERPRET=0 python3 benchmarks/argmax_micro.py --out x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Callable

import torch

from tidal_engine.kernels.gemv_choice import time_in_graphs
from tidal_engine.kernels.triton.argmax import argmax_rows, default_chunk

VOCAB = 151936
CASES: list[tuple[int, torch.dtype]] = [(1, torch.float32), (4, torch.float32), (64, torch.float32),
                                        (256, torch.float32), (1, torch.bfloat16)]
CHUNKS = (1024, 2048, 4096, 8192)
INPUTS = 4  # logits tensors the 32 calls cycle through


def candidates() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "torch": lambda x: x.argmax(dim=-1),
        "argmax_rows": argmax_rows,
    }
    for chunk in CHUNKS:
        fns[f"argmax_rows_chunk{chunk}"] = lambda x, chunk=chunk: argmax_rows(x, chunk=chunk)
    return fns


def check(fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], inputs: list[torch.Tensor]) -> None:
    """Raise unless every candidate gives torch.argmax's indices on every input."""
    for i, x in enumerate(inputs):
        expected = x.argmax(dim=-1)
        for name, fn in fns.items():
            got = fn(x)
            if not torch.equal(got, expected):
                wrong = (got != expected).nonzero().flatten().tolist()
                raise AssertionError(f"{name} disagrees with torch.argmax on input {i}, rows {wrong[:8]}")


def bench_case(m: int, dtype: torch.dtype) -> dict[str, float | int | str]:
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = [torch.randn(m, VOCAB, device="cuda", generator=gen).to(dtype) for _ in range(INPUTS)]
    fns = candidates()
    check(fns, inputs)
    seconds = time_in_graphs(fns, inputs)
    row: dict[str, float | int | str] = {name: 1e6 * s for name, s in seconds.items()}
    row = {f"{name}_us": value for name, value in row.items()}
    row["default_chunk"] = default_chunk(inputs[0].element_size())
    row["speedup"] = row["torch_us"] / row["argmax_rows_us"]
    row["argmax_rows_GB_s"] = m * VOCAB * inputs[0].element_size() / row["argmax_rows_us"] / 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    results: dict[str, object] = {}
    for m, dtype in CASES:
        name = f"M{m} {str(dtype).removeprefix('torch.')}"
        row = bench_case(m, dtype)
        results[name] = row
        sweep = ", ".join(f"{c}: {row[f'argmax_rows_chunk{c}_us']:.2f}" for c in CHUNKS)
        print(f"{name} V{VOCAB}: torch {row['torch_us']:.2f} us, argmax_rows {row['argmax_rows_us']:.2f} us "
              f"(chunk {row['default_chunk']}; by chunk {sweep})", flush=True)
        text = json.dumps({"commit": os.environ.get("TIDAL_COMMIT", "unknown"),
                           "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": VOCAB,
                           "calls_per_graph": 32, "results": results}, indent=1)
        if args.out:  # after every case, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
