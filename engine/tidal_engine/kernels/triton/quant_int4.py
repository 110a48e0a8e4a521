"""INT4 (AWQ / GPTQ) kernels over the layout quantization/int4.py repacks both formats into:
``qweight`` int32 ``[N, K/8]`` (input ``8j + i`` of a row in nibble ``i`` of word ``j``),
``scales`` and ``zeros`` ``[N, K/g]`` in the run dtype, ``w[n, k] = (q - zeros[n, k/g]) * scales[n, k/g]``.

- ``int4_gemv``: a few rows (decode). Each program streams ``BLOCK_N`` weight rows as words
  and never builds the dequantized tile: a word's 8 inputs share one group, so
  ``sum_i (q_i - z) s x_i = s (sum_i q_i x_i - z sum_i x_i)`` costs one shift, mask, convert
  and fma per weight plus a few operations per word. Input rows are the fastest grid axis,
  so the programs of a few rows share each weight tile through L2.
- ``int4_gemm``: more rows (prefill, large decode batches). A ``[BLOCK_K, BLOCK_N]`` tile of
  words is read (each word once per nibble: the loads of one word coalesce), unpacked and
  dequantized to the activations' dtype in registers, then ``tl.dot``. ``BLOCK_K`` divides
  the group size, so a tile needs one scale and zero per output column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton.gemv import GemvConfig, check_grid_rows

PACK = 8
FLOAT_2_23_BITS = 0x4B000000  # float32 2^23: a small integer or-ed into its mantissa reads as 2^23 + it

# The candidates timed at start-up (kernels/gemv_choice.py); block_k counts weights (8 a word).
INT4_GEMV_CONFIGS: tuple[GemvConfig, ...] = (
    GemvConfig(4, 512, 4),
    GemvConfig(8, 256, 4),
    GemvConfig(8, 512, 4),
    GemvConfig(8, 1024, 8),
    GemvConfig(16, 256, 4),
    GemvConfig(16, 512, 4),
    GemvConfig(16, 1024, 8),
    GemvConfig(32, 256, 4),
    GemvConfig(32, 512, 8),
)


@triton.jit
def _nibble_to_float(words, i):
    """Nibble ``i`` (0..7, or a tensor of them) of int32 ``words`` as float32 0..15. The bits go
    into the mantissa of 2^23 and 2^23 is subtracted: two full-rate operations instead of an
    int-to-float conversion, which runs at a quarter of the rate and bounds the GEMV."""
    return (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


# A word's nibble i is q * 16^(i%4) as a float after masking it in place (the upper four
# nibbles after one shift by 16) and the 2^23 trick: a mask-or and an add per weight, then the
# multiply-add with x_i / 16^(i%4), exact (a power of two).
# stride_qn stays unspecialised: with the rows' alignment unknown the words load one per
# thread, each thread then holds several rows of one word column, and the 8 activation
# loads of a word serve all of them (with 4-word vector loads each thread would reload x
# for 4 columns: 4× the L1 traffic).
@triton.jit(do_not_specialize=["stride_qn"])
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
):
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_sn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    words_per_row = K // 8
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for w0 in range(0, words_per_row, BLOCK_W):
        j = w0 + tl.arange(0, BLOCK_W)
        group = (j * 8 // GROUP)[None, :]
        if EVEN:  # no masks: N and K/8 are multiples of the tile
            words = tl.load(q_rows + j[None, :])
            s = tl.load(s_rows + group).to(tl.float32)
            z = tl.load(z_rows + group).to(tl.float32)
        else:
            j_ok = j < words_per_row
            ok = row_ok[:, None] & j_ok[None, :]
            words = tl.load(q_rows + j[None, :], mask=ok, other=0)
            s = tl.load(s_rows + group, mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_rows + group, mask=ok, other=0.0).to(tl.float32)
        high = words >> 16
        dot = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        x_sum = tl.zeros([BLOCK_W], tl.float32)
        for i in tl.static_range(8):
            if EVEN:
                x_i = tl.load(x_row + j * 8 + i).to(tl.float32)
            else:
                x_i = tl.load(x_row + j * 8 + i, mask=j < words_per_row, other=0.0).to(tl.float32)
            x_sum += x_i
            # Nibble i in place (times 16^(i%4)) in the mantissa; x_i carries the 16^-(i%4).
            # ``magic`` (2^23's bits) is an argument, not a constant, so the mask and the or
            # fuse into one three-input logic operation.
            half = words if i < 4 else high
            place = (half & (0xF << (4 * (i % 4)))) | magic
            weight = place.to(tl.float32, bitcast=True) - 8388608.0
            dot += weight * (x_i * (1.0 / (1 << (4 * (i % 4)))))[None, :]
        acc += s * (dot - z * x_sum[None, :])
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"int4 kernels take x of shape [M, K]; got {tuple(x.shape)}")
    n, words = qweight.shape
    k = words * PACK
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, qweight holds {k}")
    if k % group_size or group_size % PACK:
        raise ValueError(f"group size {group_size} must be a multiple of {PACK} that divides {k}")
    if tuple(scales.shape) != (n, k // group_size) or scales.shape != zeros.shape or scales.stride() != zeros.stride():
        raise ValueError(f"scales and zeros must both be [{n}, {k // group_size}] with the same strides")
    if qweight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("qweight's and scales' last dims must be contiguous")


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias)`` → ``[M, N]`` in x's dtype, for small M."""
    _check(x, qweight, scales, zeros, group_size)
    n, words = qweight.shape
    if config.block_k % PACK:
        raise ValueError(f"block_k {config.block_k} is not a whole number of words")
    check_grid_rows(n, config.block_n)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_w = config.block_k // PACK
    _int4_gemv_kernel[(m, triton.cdiv(n, config.block_n))](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, n, words * PACK, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), FLOAT_2_23_BITS, GROUP=group_size,
        BLOCK_N=config.block_n, BLOCK_W=block_w, HAS_BIAS=bias is not None,
        EVEN=n % config.block_n == 0 and words % block_w == 0, num_warps=config.num_warps,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    shifts = (kk % 8)[:, None]
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    q_tile = q_ptr + cols.to(tl.int64)[None, :] * stride_qn + (kk // 8)[:, None]
    s_cols = s_ptr + cols.to(tl.int64) * stride_sn
    z_cols = z_ptr + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, GROUP of BLOCK_K: no K mask
        x = tl.load(x_tile + k0, mask=row_ok[:, None], other=0.0)
        words = tl.load(q_tile + k0 // 8, mask=col_ok[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(s_cols + g, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_cols + g, mask=col_ok, other=0.0).to(tl.float32)
        w = ((_nibble_to_float(words, shifts) - z[None, :]) * s[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemm_tiles(m: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows: two variants only, so the
    decode graphs' many batch sizes compile no kernel inside a capture."""
    block_k = next((b for b in (64, 32, 16) if group_size % b == 0), 0)
    if not block_k:
        raise ValueError(f"the INT4 GEMM needs a group size that is a multiple of 16, not {group_size}")
    if m <= 16:
        return 16, 64, block_k, 4, 4
    return 64, 128, block_k, 4, 3


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias)`` → ``[M, N]`` in x's dtype (fp32 accumulation)."""
    _check(x, qweight, scales, zeros, group_size)
    n, words = qweight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or gemm_tiles(m, group_size)
    if group_size % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, m, n, words * PACK, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
    )
    return out


__all__ = ["INT4_GEMV_CONFIGS", "gemm_tiles", "int4_gemm", "int4_gemv"]
