"""Matrix-vector products for one-row and few-row inputs: ``y = x W^T + b``, x ``[M, K]``.

At batch 1 every linear layer is a pure weight read, and cuBLAS's GEMM kernels reach only
1-3 TB/s on the few-megabyte matrices of a small model (its tiles are built for many rows).
This kernel gives each program ``BLOCK_N`` output rows and streams their weights in
``BLOCK_K``-wide, fully contiguous tiles, accumulating ``w * x`` in fp32 and reducing once at
the end. Which tile shape wins (or whether cuBLAS does) depends on the matrix and the GPU, so
``kernels/gemv_choice.py`` times the candidates once per weight shape at start-up.

``gemv_rows`` takes 2 to ``GEMV_ROWS_MAX`` rows (a speculative verify step of one sequence has
k + 1 = 5): each program reads its ``BLOCK_N`` weight rows once for all input rows, which ride
as the 16-row side of a tensor-core product (``tl.dot(w, x^T)``; padding rows are masked, and
for a memory-bound product their multiplies cost nothing). cuBLAS's GEMMs are built for many
rows; at a few rows they read the weights at a fraction of the bandwidth. Chosen per weight
shape and row bucket (2, 4, 8) by measurement, as the one-row kernel is.

The one-row kernel takes ``silu_and_mul=True`` for a gated MLP's gate_up projection: the weight
is gate|up, ``[2I, K]``; each program takes gate row i next to up row I + i for its
``BLOCK_N / 2`` activations and writes ``silu(gate) * up`` (kernels/triton/activation.py's
arithmetic, on the sums rounded as the plain kernel stores them), so a decode step needs no
activation kernel and no ``[1, 2I]`` intermediate, and each activation is made once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import pdl_launch, pdl_wait
from tidal_engine.kernels.triton.activation import silu_mul


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


def check_gated(n: int, block_n: int) -> tuple[int, int]:
    """A gate|up weight of ``n`` rows in tiles of ``block_n`` rows: (activations, activations a
    program); a tile holds gate/up pairs."""
    if not _holds_gate_up_pairs(n, block_n):
        raise ValueError(f"silu_and_mul needs an even number of weight rows ({n}) and of rows a tile ({block_n})")
    return n // 2, block_n // 2


def _holds_gate_up_pairs(n: int, block_n: int) -> bool:
    """A gate|up weight of ``n`` rows in tiles of ``block_n`` rows: whole gate/up pairs a tile."""
    return n % 2 == 0 and block_n >= 2 and block_n % 2 == 0


def tile_folds_silu_and_mul(config: "GemvConfig | None", n: int) -> bool:
    """Whether a one-row tile can apply SiLU-and-mul in its epilogue to a gate|up weight of
    ``n`` rows (``check_gated``'s rule; None, cuBLAS, cannot)."""
    return config is not None and _holds_gate_up_pairs(n, config.block_n)


@triton.jit
def program_rows(pid, N, BLOCK_N: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """Program ``pid``'s weight rows, and which exist. With ``SILU_AND_MUL`` (a gate|up GEMV
    with ``N`` activations) tile row 2j is gate row i and 2j + 1 up row N + i, for its
    ``BLOCK_N // 2`` activations i; else ``BLOCK_N`` consecutive rows."""
    r = tl.arange(0, BLOCK_N)
    if SILU_AND_MUL:
        outs = pid * (BLOCK_N // 2) + r // 2
        rows = outs + (r % 2) * N
        row_ok = outs < N
    else:
        rows = pid * BLOCK_N + r
        row_ok = rows < N
    return rows, row_ok


@triton.jit
def store_rows(out_row, y, rows, row_ok, pid, N, BLOCK_N: tl.constexpr, SILU_AND_MUL: tl.constexpr):
    """Store a program's fp32 sums ``y`` (its ``rows``); with ``SILU_AND_MUL`` (rows from
    ``program_rows``) its ``silu(gate) * up`` instead: gate and up rounded as the plain store would
    round them, then the activation kernel's arithmetic."""
    if SILU_AND_MUL:
        gate, up = tl.split(tl.reshape(y.to(out_row.dtype.element_ty).to(tl.float32), (BLOCK_N // 2, 2)))
        outs = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row + outs, silu_mul(gate, up).to(out_row.dtype.element_ty), mask=outs < N)
    else:
        tl.store(out_row + rows, y.to(out_row.dtype.element_ty), mask=row_ok)


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


# Inputs of 2 to this many rows may go to ``gemv_rows`` (its dot pads them to 16). The choice
# against cuBLAS is made per bucket (timed at the bucket's row count; a row count uses the
# smallest bucket that holds it), since cuBLAS's kernel for 2 rows is not its kernel for 8.
GEMV_ROWS_MAX = 8
GEMV_ROW_BUCKETS = (2, 4, 8)

# Its candidates: block_n >= 16 (the dot's smallest tile side), the weight tile streamed in
# GEMV_ROWS_STAGES software-pipelined stages.
GEMV_ROWS_CONFIGS: tuple[GemvConfig, ...] = (
    GemvConfig(16, 128, 4),
    GemvConfig(16, 256, 4),
    GemvConfig(16, 512, 4),
    GemvConfig(32, 128, 4),
    GemvConfig(32, 256, 4),
    GemvConfig(64, 128, 4),
    GemvConfig(64, 256, 8),
)
GEMV_ROWS_STAGES = 4
_ROWS_PAD = 16  # the input rows' side of the dot


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
    SILU_AND_MUL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    rows, row_ok = program_rows(tl.program_id(0), N, BLOCK_N, SILU_AND_MUL)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PDL:  # the first tile's weights load while the kernel before this one finishes
        k = tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        pdl_wait(PDL)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += w * x[None, :]
        k_begin = BLOCK_K
    else:
        k_begin = 0
    for k0 in range(k_begin, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_rows(out_ptr, y, rows, row_ok, tl.program_id(0), N, BLOCK_N, SILU_AND_MUL)


@triton.jit
def _gemv_rows_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_M], fp32
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + ms.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` → ``[M, N]`` in x's dtype, for 1 <= M <=
    ``GEMV_ROWS_MAX``; each weight element is read once (fp32 accumulation)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_ROWS_MAX:
        raise ValueError(f"gemv_rows takes 1 to {GEMV_ROWS_MAX} rows, x of shape [M, K]; got {tuple(x.shape)}")
    if config.block_n < _ROWS_PAD:
        raise ValueError(f"gemv_rows needs block_n >= {_ROWS_PAD}, got {config.block_n}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, weight expects {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError("weight's last dim must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = pdl_launch(x.device)
    _gemv_rows_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,  # unused without a bias
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=_ROWS_PAD,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        NUM_STAGES=GEMV_ROWS_STAGES,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 (tests): no TF32 rounding
        PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
         silu_and_mul: bool = False) -> torch.Tensor:
    """``x [1, K] @ weight [N, K]^T (+ bias [N])`` → ``[1, N]`` in x's dtype (fp32 accumulation).
    ``silu_and_mul``: the weight is gate|up (N = 2I) and the result ``silu(gate) * up``, ``[1, I]``."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, x of shape [1, K]; got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects {k}")
    if weight.stride(1) != 1:
        raise ValueError("weight's last dim must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_out, rows_a_program = check_gated(n, config.block_n) if silu_and_mul else (n, config.block_n)
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n_out, rows_a_program),)
    pdl = pdl_launch(x.device)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,  # unused without a bias
        out,
        n_out,
        k,
        weight.stride(0),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        SILU_AND_MUL=silu_and_mul,
        PDL=pdl,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


__all__ = ["GEMV_CONFIGS", "GEMV_ROWS_CONFIGS", "GEMV_ROWS_MAX", "GEMV_ROW_BUCKETS", "GemvConfig", "check_gated", "check_grid_rows",
           "gemv", "gemv_rows", "program_rows", "store_rows",
           "tile_folds_silu_and_mul"]
