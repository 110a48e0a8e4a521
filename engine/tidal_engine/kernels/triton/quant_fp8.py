"""FP8 (e4m3) kernels for the W8A8 linear (quantization/fp8.py).

- ``fp8_gemv``: ``y = x (W * scale)^T + b`` for a few rows of 16-bit activations and e4m3
  weights with one fp32 scale per output row. Decode at batch 1 is a pure weight read, so
  halving the weight bytes is the whole gain; the weights are widened in registers,
  multiplied in fp32, and the row scale is applied once after the reduction. The
  activations are not quantized here (W8A16), which is slightly more exact than the W8A8
  path of larger batches. Each program takes ``BLOCK_N`` output rows of one input row;
  the input rows' programs of one weight tile run next to each other (input row is the
  fastest grid axis), so a few rows read the weights from HBM about once. An fp8 tile holds
  half the bytes of a bf16 one, so a program keeps fewer bytes in flight for the registers
  its accumulator costs; ``num_stages`` > 1 software-pipelines the K loop (the weight and
  activation tiles stream through shared memory that many iterations ahead, by cp.async).
  With ``silu_and_mul`` the weight is a gated MLP's gate|up and the kernel writes
  ``silu(gate) * up``: a program takes gate row i next to up row i and activates its pairs
  after the sums (decode runs without the activation kernel).
- ``quantize_rows_fp8``: dynamic per-token activation quantization in one kernel (absmax of
  the row → scale = absmax / 448 → e4m3), in front of ``torch._scaled_mm`` for larger batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import pdl_launch, pdl_wait
from tidal_engine.kernels.triton.gemv import GemvConfig, check_gated, check_grid_rows, program_rows, store_rows

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)  # an all-zero row still gets a finite scale (as quantization/fp8.py)



@dataclass(frozen=True)
class Fp8GemvConfig(GemvConfig):
    """A GemvConfig with ``num_stages``: 1 is the plain loop, more pipelines it."""

    num_stages: int = 1


# The candidates timed at start-up (kernels/gemv_choice.py): one byte a weight, so wider K
# tiles, and deep pipelines: a 4096-row matrix in 8-row tiles is only 512 programs, under 4 an
# SM, so each must keep several tiles in flight. On the H200 (2026-12-01e) every one-row winner
# and runner-up within 5% at the 8B shapes is here (4-6 stages beat the earlier 3 by 2-6%); the
# plain loops, split K and programmatic-dependent-launch variants measured there are not
# (benchmarks/results/h200-2026-12-01e-fp8w: PDL then ran on these GEMVs alone, behind kernels
# launched without it; the whole decode chain launches with it since, kernels/triton/_common.py).
FP8_GEMV_CONFIGS: tuple[Fp8GemvConfig, ...] = (
    Fp8GemvConfig(8, 512, 4, 3),
    Fp8GemvConfig(8, 512, 4, 4),
    Fp8GemvConfig(8, 512, 4, 6),
    Fp8GemvConfig(8, 1024, 4, 4),
    Fp8GemvConfig(4, 512, 2, 6),
    Fp8GemvConfig(16, 512, 8, 3),
)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # the pipelined loop loads weights and activations together
    m = tl.program_id(0)
    rows, row_ok = program_rows(tl.program_id(1), N, BLOCK_N, SILU_AND_MUL)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out_row = out_ptr + m.to(tl.int64) * stride_om
    store_rows(out_row, y, rows, row_ok, tl.program_id(1), N, BLOCK_N, SILU_AND_MUL)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig, silu_and_mul: bool = False) -> torch.Tensor:
    """``x [M, K]`` (16/32-bit) @ ``(weight [N, K] e4m3 * scale [N, 1])^T (+ bias)`` → ``[M, N]`` in x's dtype.
    ``config``: a GemvConfig, or an Fp8GemvConfig to pipeline the loop. ``silu_and_mul``: the
    weight is gate|up (N = 2I) and the result ``silu(gate) * up``, ``[M, I]``: bit for bit the
    activation kernel on the plain result (``config.block_n`` >= 2: its rows are pairs)."""
    if x.dim() != 2:
        raise ValueError(f"fp8_gemv takes x of shape [M, K]; got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects {k}")
    if weight.stride(1) != 1 or scale.numel() != n:
        raise ValueError("weight's last dim must be contiguous and scale must hold one value per output row")
    n_out, rows_a_program = check_gated(n, config.block_n) if silu_and_mul else (n, config.block_n)
    check_grid_rows(n_out, rows_a_program)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    pdl = pdl_launch(x.device)
    _fp8_gemv_kernel[(m, triton.cdiv(n_out, rows_a_program))](
        x, weight, scale, bias if bias is not None else scale, out, n_out, k, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_N=config.block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None,
        STAGES=getattr(config, "num_stages", 1), SILU_AND_MUL=silu_and_mul, PDL=pdl, num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):  # the second read of the row comes from L1/L2
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows_fp8(x: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``[M, K]`` e4m3, float32 scale ``[M, 1]``) with ``x ≈ q * scale``, as
    quantization/fp8.py's ``quantize_tokens``. ``out_dtype=float32`` stores the scaled, clamped
    values before the e4m3 rounding (the CPU interpreter's e4m3 rounding is not exact)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 takes x of shape [M, K]; got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block,
                                num_warps=8 if block >= 2048 else 4)
    return q, scale


__all__ = ["FP8_GEMV_CONFIGS", "Fp8GemvConfig", "fp8_gemv", "quantize_rows_fp8"]
