"""Matrix-vector product for one-row inputs (single-stream decode): ``y = x W^T + b``, x ``[1, K]``.

At batch 1 every linear layer is a pure weight read, and cuBLAS's GEMM kernels reach only
1-3 TB/s on the few-megabyte matrices of a small model (its tiles are built for many rows).
This kernel gives each program ``BLOCK_N`` output rows and streams their weights in
``BLOCK_K``-wide, fully contiguous tiles, accumulating ``w * x`` in fp32 and reducing once at
the end. Which tile shape wins (or whether cuBLAS does) depends on the matrix and the GPU, so
``kernels/gemv_choice.py`` times the candidates once per weight shape at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def check_grid_rows(n: int, block_n: int) -> None:
    """Small-batch kernels put the output-row tiles on the grid's second dimension."""
    if -(-n // block_n) > MAX_GRID_Y:
        raise ValueError(f"{n} output rows need more than {MAX_GRID_Y} programs of {block_n} rows")


# The candidates timed at start-up (each one compiled variant per dtype).
GEMV_CONFIGS: tuple[GemvConfig, ...] = (
    GemvConfig(1, 1024, 4),
    GemvConfig(2, 512, 4),
    GemvConfig(2, 1024, 4),
    GemvConfig(4, 512, 4),
    GemvConfig(4, 1024, 4),
    GemvConfig(8, 512, 4),
    GemvConfig(8, 1024, 8),
    GemvConfig(16, 256, 4),
    GemvConfig(16, 512, 8),
)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """``x [1, K] @ weight [N, K]^T (+ bias [N])`` → ``[1, N]`` in x's dtype (fp32 accumulation)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, x of shape [1, K]; got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects {k}")
    if weight.stride(1) != 1:
        raise ValueError("weight's last dim must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n),)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,  # unused without a bias
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps,
    )
    return out


__all__ = ["GEMV_CONFIGS", "GemvConfig", "gemv"]
