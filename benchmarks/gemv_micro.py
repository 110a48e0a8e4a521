"""One-row linear on the GPU: cuBLAS (F.linear) against the Triton GEMV's tile shapes.

Times ``[1, K] x [N, K]^T`` in bf16 for the weight shapes of the Qwen3-0.6B and -8B decode
step, 32 calls captured in one CUDA graph (as the decode step runs them: no launch overhead), the
weights rotated through enough copies to exceed the L2 cache (a real decode step reads each
weight once per token). Prints one line per shape; ``--out`` writes the JSON.

    PYTHONPATH=engine TRITON_INTERPRET=0 python benchmarks/gemv_micro.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from tidal_engine.kernels.gemv_choice import rotation_copies, time_in_graph
from tidal_engine.kernels.triton.gemv import GemvConfig, gemv

SHAPES = {
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)],
    "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
}
CONFIGS = [GemvConfig(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8))
           if n * k <= 16384]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    results: dict[str, object] = {}
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            nbytes = n * k * 2
            copies = rotation_copies((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
            x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
            row: dict[str, float] = {"cublas_us": 1e6 * time_in_graph(lambda w: torch.nn.functional.linear(x, w), copies)}
            for c in CONFIGS:
                try:
                    row[f"{c.block_n}x{c.block_k}w{c.num_warps}"] = 1e6 * time_in_graph(lambda w, c=c: gemv(x, w, None, c), copies)
                except Exception as exc:  # a tile too big for this shape's registers, etc.
                    row[f"{c.block_n}x{c.block_k}w{c.num_warps}"] = float("nan")
                    print(f"{n}x{k} {c}: {type(exc).__name__}", flush=True)
            best = min((v, name) for name, v in row.items() if name != "cublas_us" and v == v)
            row["best_gemv"] = best[1]
            row["best_gemv_us"] = best[0]
            row["cublas_TB_s"] = nbytes / row["cublas_us"] / 1e6
            row["best_gemv_TB_s"] = nbytes / best[0] / 1e6
            results[f"{model} {n}x{k}"] = row
            print(f"{model} {n}x{k}: cuBLAS {row['cublas_us']:.1f} us, best GEMV {best[1]} {best[0]:.1f} us", flush=True)
            del copies
    text = json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
