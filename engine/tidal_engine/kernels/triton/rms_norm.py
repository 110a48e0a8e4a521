"""Fused RMSNorm, optionally with the residual add in front of it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import (FLOAT_DTYPES, check_dtype, check_same_device, next_power_of_2, pdl_launch,
                                                 pdl_wait)

_MAX_HIDDEN = 65536  # one row per program in one tile; wider rows would spill registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no earlier kernel writes it
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype first: it is the residual the next layer sees,
        # and normalising that same value matches the unfused (HF) computation.
        s = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # Normalise in fp32, round to the output dtype, then scale by the weight (HF's order).
    y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    rows = t.reshape(-1, n)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x [..., N] and weight [N] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    n = x.shape[-1]
    if n > _MAX_HIDDEN:
        raise ValueError(f"hidden size {n} > {_MAX_HIDDEN} not supported")
    x2 = _as_rows(x, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        check_same_device(x=x, residual=residual, weight=weight)
        r2 = _as_rows(residual, n)
        r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        check_same_device(x=x, weight=weight)
        r2, r_out = x2, out  # unused by the kernel (HAS_RESIDUAL=False)
    if x2.shape[0] > 0:
        block = next_power_of_2(n)
        pdl = pdl_launch(x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            r_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            r_out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            PDL=pdl,
            num_warps=min(16, max(1, block // 256)),
            launch_pdl=pdl,
        )
    return out.view(x.shape), (r_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim of ``x [..., N]`` (any
    leading dims, e.g. per-head q/k norms on ``[T, H, D]``); statistics in fp32, result in
    x's dtype. Matches ``kernels.reference.rms_norm_ref``."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass for the pre-norm residual pattern: ``s = x + residual`` (rounded to x's dtype),
    returns ``(rms_norm(s, weight, eps), s)`` as new tensors. Matches
    ``kernels.reference.fused_add_rms_norm_ref``."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


@triton.jit
def _rms_norm_heads_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token normalises every head of it: [H, D] is one small tile.
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + tok * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    w = tl.load(weight_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    y = (x * inv_rms[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    o = tok * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x [T, H, D]`` (Qwen3's q/k norm) without copying a strided view
    first: ``x`` may be a slice of a fused QKV output (any token and head strides, contiguous
    last dim). Returns a new contiguous ``[T, H, D]``; same numbers as ``rms_norm``."""
    if x.dim() != 3 or weight.dim() != 1 or x.shape[2] != weight.shape[0]:
        raise ValueError(f"x [T, H, D] and weight [D] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_same_device(x=x, weight=weight)
    if x.stride(2) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        _rms_norm_heads_kernel[(num_tokens,)](
            x,
            weight,
            out,
            x.stride(0),
            x.stride(1),
            eps,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=next_power_of_2(num_heads),
            DIM_PAD=next_power_of_2(head_dim),
            num_warps=4,
        )
    return out


__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_heads"]
