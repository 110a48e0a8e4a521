"""Segmented LoRA matmuls (SGMV style, as in Punica / S-LoRA), in Triton, with a torch reference.

A mixed batch is a list of *segments*: runs of consecutive rows (tokens) that use the same
adapter slot. Base-model rows belong to no segment and are left alone. Two kernels:

- ``sgmv_shrink``: ``t[rows] = x[rows] @ A[slot]^T`` (``A``: ``[slots, N, K]``, N = stacked ranks),
  accumulated and stored in float32;
- ``sgmv_expand``: ``y[rows] += t[rows] @ B[slot]^T`` (``B``: ``[slots, out, R]``), in place.

Merged layers (qkv, gate_up) call shrink once over the stacked A and expand once per shard
with column views of ``t``, ``B`` and ``y`` (views carry their offsets and strides).
Grid: (segment, row block, column block); row blocks past a segment's end are fully
masked, so one launch covers segments of any length (decode segments are 1 row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import FLOAT_DTYPES, check_dtype, check_same_device, next_power_of_2


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, t_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    K, N,
    stride_xm, stride_xk, stride_al, stride_an, stride_ak, stride_tm, stride_tn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    row_block = tl.program_id(1)
    col_block = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < length
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + (start + rows)[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :], other=0.0,
        )
        a = tl.load(  # A[slot] read transposed: [BLOCK_K, BLOCK_N]
            a_ptr + slot * stride_al + cols[None, :] * stride_an + ks[:, None] * stride_ak,
            mask=col_mask[None, :] & k_mask[:, None], other=0.0,
        )
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(
        t_ptr + (start + rows)[:, None] * stride_tm + cols[None, :] * stride_tn,
        acc, mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _sgmv_expand_kernel(
    t_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, R,
    stride_tm, stride_tr, stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    row_block = tl.program_id(1)
    col_block = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_mask = rows < length
    col_mask = cols < N
    r_mask = ranks < R
    t = tl.load(
        t_ptr + (start + rows)[:, None] * stride_tm + ranks[None, :] * stride_tr,
        mask=row_mask[:, None] & r_mask[None, :], other=0.0,
    )
    b = tl.load(  # B[slot] read transposed: [BLOCK_R, BLOCK_N]
        b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
        mask=col_mask[None, :] & r_mask[:, None], other=0.0,
    ).to(tl.float32)
    delta = tl.dot(t, b, input_precision=PRECISION)
    y_ptrs = y_ptr + (start + rows)[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    if not (seg_starts.shape == seg_lens.shape == seg_slots.shape) or seg_starts.dim() != 1:
        raise ValueError("seg_starts, seg_lens and seg_slots must be 1-D tensors of one length")


def _precision(dtype: torch.dtype) -> str:
    # fp32 activations: exact fp32 products (TF32 would lose ~3 digits); half types: the default.
    return "ieee" if dtype == torch.float32 else "tf32"


def sgmv_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``t[rows of seg] = x[rows] @ a[slot of seg]^T`` in float32. x ``[T, K]``, a ``[L, N, K]``;
    returns ``[T, N]`` (rows outside every segment are left uninitialised)."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_same_device(x=x, a=a, seg_starts=seg_starts)
    _check_segments(seg_starts, seg_lens, seg_slots)
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"shapes don't fit: x {tuple(x.shape)}, a {tuple(a.shape)}")
    if a.dtype != x.dtype:
        raise TypeError(f"a has dtype {a.dtype}, x {x.dtype}: they must match")
    num_tokens, k = x.shape
    n = a.shape[1]
    t = out if out is not None else torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    num_segs = seg_starts.shape[0]
    if num_segs == 0 or max_seg_len == 0:
        return t
    block_m = 16
    block_n = max(16, min(64, next_power_of_2(n)))
    block_k = 32
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _sgmv_shrink_kernel[grid](
        x, a, t, seg_starts, seg_lens, seg_slots,
        k, n,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), t.stride(0), t.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype),
    )
    return t


def sgmv_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """``y[rows of seg] += t[rows] @ b[slot of seg]^T``, in place. t ``[T, R]`` float32 (a
    column view is fine), b ``[L, N, R]``, y ``[T, N]`` (a column view is fine). Returns y."""
    check_dtype("y", y, FLOAT_DTYPES)
    check_same_device(t=t, b=b, y=y, seg_starts=seg_starts)
    _check_segments(seg_starts, seg_lens, seg_slots)
    if t.dim() != 2 or b.dim() != 3 or y.dim() != 2 or b.shape[2] != t.shape[1] or b.shape[1] != y.shape[1]:
        raise ValueError(f"shapes don't fit: t {tuple(t.shape)}, b {tuple(b.shape)}, y {tuple(y.shape)}")
    if t.dtype != torch.float32:
        raise TypeError("t must be float32 (sgmv_shrink's output)")
    num_segs = seg_starts.shape[0]
    if num_segs == 0 or max_seg_len == 0:
        return y
    n, r = b.shape[1], b.shape[2]
    block_m = 16
    block_n = max(16, min(64, next_power_of_2(n)))
    block_r = max(16, next_power_of_2(r))
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _sgmv_expand_kernel[grid](
        t, b, y, seg_starts, seg_lens, seg_slots,
        n, r,
        t.stride(0), t.stride(1), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=_precision(torch.float32),
    )
    return y


# ---------------------------------------------------------------------- torch reference


def sgmv_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """What ``sgmv_shrink`` computes, segment by segment (rows outside segments are 0)."""
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        rows = slice(start, start + length)
        t[rows] = x[rows].float() @ a[slot].float().T
    return t


def sgmv_expand_reference(
    t: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
    seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
) -> torch.Tensor:
    """What ``sgmv_expand`` computes (in place on ``y``)."""
    for start, length, slot in zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()):
        rows = slice(start, start + length)
        y[rows] = (y[rows].float() + t[rows].float() @ b[slot].float().T).to(y.dtype)
    return y
