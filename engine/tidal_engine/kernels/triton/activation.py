"""SiLU-and-mul: the gated MLP activation of Llama/Qwen.

``silu_mul`` is the arithmetic itself, shared with the decode GEMVs that compute a gated MLP's
gate and up rows side by side and activate them in their epilogue (kernels/triton/gemv.py,
quant_fp8.py): both start from gate and up rounded to the run dtype, so a folded GEMV stores
exactly what this kernel stores after the plain GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import FLOAT_DTYPES, check_dtype, next_power_of_2


@triton.jit
def silu_mul(gate, up):
    """``silu(gate) * up`` of fp32 values, in fp32 (the caller rounds once)."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(gate, up)  # fp32 throughout, one rounding at the store
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]`` in x's dtype
    (the gate half first, as in a fused gate_up projection). Matches
    ``kernels.reference.silu_and_mul_ref``."""
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [..., 2 * I], got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and inter > 0:
        block = min(1024, next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)


__all__ = ["silu_and_mul", "silu_mul"]
