"""INT4 (g128, asymmetric) linears of the Qwen3-8B decode step on the GPU, one kernel at a time.

For each weight shape: bf16 cuBLAS (``F.linear`` on the dequantized weights) at 1, 4, 16 and
128 rows; the INT4 GEMM at those rows (its default tiles, and a few alternatives at 16 and 128
rows); every INT4 GEMV candidate (kernels/triton/quant_int4.py: by groups, by groups in packed
halves, by words, on tensor cores; split-K ones named ``...,splitS)``, prefetching ones
``...,stages2)``) at 1 and 4 rows, and a few more packed-halves tiles at 1 row (``--sweep``: many
more, ``SWEEP_TILES``). Each time is
32 calls captured in one CUDA graph, the weights rotated through enough copies to exceed the
L2 cache (kernels/gemv_choice.py's ``time_in_graph``, as the start-up choice times them).
Bandwidth counts the INT4 words plus the scales and zeros (bf16: the 16-bit weights).
``err_r{rows}_{kernel}``: a GEMV's largest error against the fp32 product of the dequantized
weights, relative to the largest output.

The gate|up shape (``GATE_UP``) is also timed at one row as the decode step runs it: each
by-groups tile with SiLU-and-mul folded into its epilogue (``folded_r1_{kernel}_us``), and the
plain kernel followed by the activation kernel (``then_act_r1_{kernel}_us``); the activation
kernel alone on ``[1, N/2]`` is ``silu_and_mul_r1_us``. ``--rows 1`` times one row only.

    PYTHONPATH=engine TRITON_INTERPRET=0 python benchmarks/int4_micro.py [--rows 1] --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Any

import torch

from tidal_engine.kernels.gemv_choice import rotation_copies, rotation_sets, time_in_graph
from tidal_engine.kernels.triton.activation import silu_and_mul
from tidal_engine.kernels.triton.quant_int4 import (
    INT4_GEMV_CONFIGS,
    PackedGemvConfig,
    PairedPackedGemvConfig,
    gemm_tiles,
    int4_gemm,
    int4_gemv,
    int4_tile_folds_silu_and_mul,
)
from tidal_engine.quantization.int4 import dequantize, pack_rows
from tidal_engine.quantization.quantizer import quantize_int4

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
GATE_UP = (24576, 4096)
GROUP = 128
ROWS = (1, 4, 16, 128)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried besides gemm_tiles' own.
GEMM_ALTERNATIVES = {16: [(16, 16, 128, 4, 4), (16, 64, 128, 4, 4)],
                     128: [(64, 128, 128, 4, 3), (128, 64, 128, 8, 3)]}
# Packed-halves GEMV tiles timed at one row besides the start-up candidates (h200-2026-12-02-int4:
# (16, 1024, 2) was 0.2 us faster on 24576 x 4096 than the chosen tile, slower on the others); the
# unsplit twin of the 8-row split candidates; the two-words-a-sum twin of the prefetching tile
# (h200-2026-12-02-int4b: 2-9% slower; not a candidate). The 16 x 2048 tiles and the paired
# 32 x 1024 one, slower in those runs, are no longer timed (start-up of the one device call).
PACKED_ALTERNATIVES = [PackedGemvConfig(16, 1024, 2), PackedGemvConfig(8, 1024, 2), PackedGemvConfig(8, 1024, 4, 2),
                       PackedGemvConfig(32, 1024, 4, 2), PairedPackedGemvConfig(16, 1024, 4, 2)]
# --sweep: prefetching packed tiles besides those, all timed at one row since the kernels launch with
# programmatic dependent launch (rows x inputs a step, warps; the tiles of 16 x 1024 split in two with
# more warps or wider steps).
SWEEP_TILES = [PackedGemvConfig(bn, bk, w, 2) for bn, bk, w in (
    (8, 1024, 2), (16, 1024, 2), (16, 1024, 8), (16, 2048, 4), (16, 2048, 8), (16, 512, 4), (16, 512, 2),
    (32, 1024, 8), (32, 2048, 8), (32, 512, 4), (8, 2048, 4), (8, 512, 2))] + [
    PackedGemvConfig(16, 1024, 8, 2, split_k=2), PackedGemvConfig(16, 512, 4, 2, split_k=2),
    PackedGemvConfig(32, 1024, 8, 2, split_k=2), PackedGemvConfig(8, 1024, 4, 2, split_k=2)]


def config_name(config: Any) -> str:
    split, stages = getattr(config, "split_k", 1), getattr(config, "num_stages", 1)
    return (f"{type(config).__name__}({config.block_n},{config.block_k},{config.num_warps}"
            + (f",split{split}" if split != 1 else "")
            + (f",stages{stages}" if stages != 1 and isinstance(config, PackedGemvConfig) else "") + ")")


def _safe_time(fn: Any, copies: list[Any]) -> float:
    try:
        return 1e6 * time_in_graph(fn, copies)
    except Exception as exc:  # a tile this GPU cannot build: record it, keep going
        if "CUDA error" in str(exc):
            raise
        print(f"  failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return float("nan")


def bench_folded(row: dict[str, Any], x: torch.Tensor, weights: tuple[torch.Tensor, ...], expected: torch.Tensor,
                 copies: list[Any], configs: tuple[Any, ...]) -> None:
    """A gate|up weight at one row as the step runs it: each folding tile with SiLU-and-mul in its
    epilogue, and the plain kernel then the activation kernel; the error of the folded output
    against the activation of the fp32 reference."""
    n = weights[0].shape[0]
    act_expected = torch.nn.functional.silu(expected[:, :n // 2]) * expected[:, n // 2:]
    y = int4_gemv(x, *weights, GROUP, None, configs[0])
    row["silu_and_mul_r1_us"] = _safe_time(lambda _: silu_and_mul(y), copies[:1])
    for config in configs:
        if not int4_tile_folds_silu_and_mul(config, n):
            continue
        name = config_name(config)
        try:
            got = int4_gemv(x, *weights, GROUP, None, config, silu_and_mul=True).float()
        except ValueError:
            continue
        row[f"err_folded_r1_{name}"] = ((got - act_expected).abs().max() / act_expected.abs().max()).item()
        row[f"folded_r1_{name}_us"] = _safe_time(
            lambda ws, c=config: int4_gemv(x, *ws, GROUP, None, c, silu_and_mul=True), copies)
        row[f"then_act_r1_{name}_us"] = _safe_time(
            lambda ws, c=config: silu_and_mul(int4_gemv(x, *ws, GROUP, None, c)), copies)
        print(f"  gate|up {name}: folded {row[f'folded_r1_{name}_us']:.1f} us, then the activation kernel "
              f"{row[f'then_act_r1_{name}_us']:.1f} us", flush=True)


def bench_shape(n: int, k: int, rows_list: tuple[int, ...] = ROWS) -> dict[str, Any]:
    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale, zero = quantize_int4(w, GROUP, symmetric=False)  # q [N, K] 0..15, scale/zero [N, K/g]
    weights = (pack_rows(q.contiguous()), scale.to(torch.bfloat16).contiguous(), zero.to(torch.bfloat16).contiguous())
    int4_bytes = sum(t.numel() * t.element_size() for t in weights)
    deq = dequantize(*weights, GROUP, torch.bfloat16)
    del w, q
    row: dict[str, Any] = {"int4_bytes": int4_bytes, "bf16_bytes": deq.numel() * 2}
    int4_copies = rotation_sets(weights)
    bf16_copies = rotation_copies(deq)
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        expected = torch.nn.functional.linear(x.float(), deq.float())
        tol = {"rtol": 2e-2, "atol": 2e-2 * expected.abs().max().item()}
        row[f"cublas_bf16_r{rows}_us"] = _safe_time(lambda wt: torch.nn.functional.linear(x, wt), bf16_copies)
        torch.testing.assert_close(int4_gemm(x, *weights, GROUP, None).float(), expected, **tol)
        row[f"int4_gemm_r{rows}_us"] = _safe_time(lambda ws: int4_gemm(x, *ws, GROUP, None), int4_copies)
        row[f"int4_gemm_r{rows}_tiles"] = list(gemm_tiles(rows, GROUP))
        for tiles in GEMM_ALTERNATIVES.get(rows, []):
            name = "x".join(str(t) for t in tiles)
            row[f"int4_gemm_r{rows}_{name}_us"] = _safe_time(
                lambda ws, t=tiles: int4_gemm(x, *ws, GROUP, None, tiles=t), int4_copies)
        if rows <= 4:
            for config in INT4_GEMV_CONFIGS + (tuple(PACKED_ALTERNATIVES) if rows == 1 else ()):
                name = config_name(config)
                try:
                    got = int4_gemv(x, *weights, GROUP, None, config).float()
                    torch.testing.assert_close(got, expected, **tol)
                    # Largest error against the fp32 product of the dequantized weights, over its largest output.
                    row[f"err_r{rows}_{name}"] = ((got - expected).abs().max() / expected.abs().max()).item()
                except ValueError:  # the tile does not fit this shape
                    continue
                except AssertionError as exc:  # a wrong kernel: recorded, not timed (the choice skips it too)
                    row[f"wrong_r{rows}_{name}"] = str(exc)[:300]
                    print(f"  {name} at {rows} rows: WRONG", flush=True)
                    continue
                except Exception as exc:  # e.g. out of resources on this GPU
                    if "CUDA error" in str(exc):
                        raise
                    row[f"failed_r{rows}_{name}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row[f"gemv_r{rows}_{name}_us"] = _safe_time(
                    lambda ws, c=config: int4_gemv(x, *ws, GROUP, None, c), int4_copies)
        if rows == 1 and (n, k) == GATE_UP:
            bench_folded(row, x, weights, expected, int4_copies, INT4_GEMV_CONFIGS + tuple(PACKED_ALTERNATIVES))
        gemvs = {key: v for key, v in row.items() if key.startswith(f"gemv_r{rows}_") and v == v}
        if gemvs:
            best = min(gemvs, key=gemvs.__getitem__)
            row[f"best_gemv_r{rows}"] = best
            row[f"best_gemv_r{rows}_TB_s"] = int4_bytes / gemvs[best] / 1e6
        row[f"int4_gemm_r{rows}_TB_s"] = int4_bytes / row[f"int4_gemm_r{rows}_us"] / 1e6
        row[f"cublas_bf16_r{rows}_TB_s"] = row["bf16_bytes"] / row[f"cublas_bf16_r{rows}_us"] / 1e6
        print(f"{n}x{k} rows {rows}: bf16 {row[f'cublas_bf16_r{rows}_us']:.1f} us, int4 GEMM "
              f"{row[f'int4_gemm_r{rows}_us']:.1f} us" + (f", best GEMV {best} {gemvs[best]:.1f} us" if gemvs else ""),
              flush=True)
    del int4_copies, bf16_copies
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="input row counts to time")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP_TILES at one row")
    args = ap.parse_args()
    if args.sweep:
        PACKED_ALTERNATIVES.extend(SWEEP_TILES)
    results: dict[str, Any] = {}
    for n, k in SHAPES:
        results[f"{n}x{k}"] = bench_shape(n, k, tuple(args.rows))
        text = json.dumps({"commit": os.environ.get("TIDAL_COMMIT", "unknown"),
                           "date": os.environ.get("TIDAL_BENCH_DATE") or datetime.date.today().isoformat(),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": GROUP,
                           "results": results}, indent=1)
        if args.out:  # after every shape, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                f.write(text)
    if not args.out:
        print(text)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
