"""Probe (issue 15): how fast is PyTorch's own INT4 weight-only GEMV (``aten._weight_int4pack_mm``,
"tinygemm") at the Qwen3-8B linear shapes, one row, group size 128, against bf16 cuBLAS?

Our Triton by-groups INT4 GEMV's figures for the same shapes are in
benchmarks/results/h200-2026-12-01e-int4/README.md (11.6 / 9.2 / 37.3 / 20.3 µs). Each timing is
32 calls in one CUDA graph, rotating through enough weight copies to overflow the L2, so every
call reads its weights from HBM. The outputs are checked against the dequantized weights first.

    python3 benchmarks/int4_tinygemm_probe.py --out int4_tinygemm_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K): qkv, o, gate_up, down
GROUP = 128
L2_BYTES = 60 << 20


def graph_time_us(calls: list[Callable[[], Any]]) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (10 * len(calls))


def probe(n: int, k: int, inner_k_tiles: int) -> dict[str, Any]:
    device = torch.device("cuda")
    copies = max(2, -(-L2_BYTES // (n * k // 2)) + 1)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    packed, scales_zeros, reference = [], [], None
    for c in range(copies):
        q = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32)
        scale = torch.rand(k // GROUP, n, device=device, dtype=torch.bfloat16) * 0.01 + 0.001
        zero_point = torch.randint(0, 16, (k // GROUP, n), device=device).to(torch.bfloat16)
        # tinygemm dequantizes w = (q - 8) * scale + zero; AWQ/GPTQ's w = (q - z) * scale maps to
        # zero = (8 - z) * scale.
        zero = (8 - zero_point) * scale
        uint8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed.append(torch.ops.aten._convert_weight_to_int4pack(uint8, inner_k_tiles))
        scales_zeros.append(torch.stack([scale, zero], dim=2).contiguous())
        if c == 0:
            w = ((q.float() - 8) * scale.float().repeat_interleave(GROUP, 0).t()
                 + zero.float().repeat_interleave(GROUP, 0).t())
            reference = (x.float() @ w.t())
    out = torch.ops.aten._weight_int4pack_mm(x, packed[0], GROUP, scales_zeros[0])
    err = (out.float() - reference).abs().max().item() / reference.abs().max().item()
    calls = [lambda i=i: torch.ops.aten._weight_int4pack_mm(x, packed[i % copies], GROUP, scales_zeros[i % copies])
             for i in range(32)]
    tinygemm = graph_time_us(calls)
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(max(2, -(-L2_BYTES // (n * k * 2)) + 1))]
    bf16 = graph_time_us([lambda i=i: torch.nn.functional.linear(x, dense[i % len(dense)]) for i in range(32)])
    bytes_read = n * k // 2 + 2 * (k // GROUP) * n * 2
    return {"n": n, "k": k, "inner_k_tiles": inner_k_tiles, "tinygemm_us": tinygemm, "bf16_cublas_us": bf16,
            "tinygemm_TB_s": bytes_read / tinygemm / 1e6, "max_rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results: dict[str, Any] = {"benchmark": "int4_tinygemm_probe", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                               "commit": os.environ.get("TIDAL_COMMIT", ""), "date": os.environ.get("TIDAL_BENCH_DATE") or time.strftime("%Y-%m-%d"),
                               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for n, k in SHAPES:
        for tiles in (2, 4, 8):
            try:
                row = probe(n, k, tiles)
            except Exception as exc:  # an unsupported tiling or op: record it, go on
                row = {"n": n, "k": k, "inner_k_tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:300]}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
