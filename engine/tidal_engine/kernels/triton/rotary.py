"""Rotary position embedding, neox style (rotate the two halves of the rotary dims)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import FLOAT_DTYPES, check_dtype, check_same_device, next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr,
    tok,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # In place on all heads of one token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h < NUM_HEADS)[:, None] & (j < ROT_HALF)[None, :]
    p1 = x_ptr + tok * stride_t + h[:, None] * stride_h + j[None, :]
    p2 = p1 + ROT_HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_KEY: tl.constexpr,
):
    # One program per token: q and k share the position, so cos/sin are loaded once.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    cs_row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(cs_row + j, mask=j < ROT_HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + ROT_HALF + j, mask=j < ROT_HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, ROT_HALF, HALF_PAD)
    if HAS_KEY:
        _rotate_heads(k_ptr, tok, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, K_HEADS_PAD, ROT_HALF, HALF_PAD)


def _head_view(name: str, x: torch.Tensor, num_tokens: int, head_dim: int) -> tuple[int, int, int]:
    """(num_heads, token stride, head stride) of ``x [T, H*D]`` or ``[T, H, D]``, without copying."""
    if x.shape[0] != num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens, positions has {num_tokens}")
    if x.dim() == 2:
        if x.shape[1] % head_dim != 0 or x.stride(1) != 1:
            raise ValueError(f"{name} [T, H*D] needs a multiple of head_dim={head_dim} and a contiguous last dim")
        return x.shape[1] // head_dim, x.stride(0), head_dim
    if x.dim() == 3:
        if x.shape[2] != head_dim or x.stride(2) != 1:
            raise ValueError(f"{name} [T, H, D] needs D == head_dim={head_dim} and a contiguous last dim")
        return x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"{name} must be [T, H*D] or [T, H, D], got shape {tuple(x.shape)}")


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox-style RoPE on ``query`` (and ``key``): for each token t and head, the first
    ``rotary_dim = cos_sin_cache.shape[1]`` dims are split in halves (x1, x2) and replaced by
    ``(x1*cos - x2*sin, x2*cos + x1*sin)`` with cos/sin from row ``positions[t]`` of
    ``cos_sin_cache [max_position, rotary_dim]`` (cos half, then sin half); dims past
    rotary_dim pass through. ``query``/``key`` are ``[T, H*D]`` or ``[T, H, D]`` and may be
    strided views (slices of a fused QKV output). Computed in fp32. With ``inplace`` the
    inputs are overwritten and returned; otherwise copies are rotated and returned.
    Matches ``kernels.reference.rotary_embedding_ref``."""
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a 1-D int32/int64 tensor, got {positions.dtype} {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 != 0 or cos_sin_cache.shape[1] > head_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim <= {head_dim}, even], got {tuple(cos_sin_cache.shape)}")
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    if key is not None:
        check_dtype("key", key, FLOAT_DTYPES)
        check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    else:
        check_same_device(positions=positions, query=query, cos_sin_cache=cos_sin_cache)
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if not inplace:
        # Out of place = rotate fresh copies; one extra copy, and the kernel stays in-place only.
        query = query.clone()
        key = key.clone() if key is not None else None
    num_tokens = positions.shape[0]
    num_q_heads, stride_qt, stride_qh = _head_view("query", query, num_tokens, head_dim)
    if key is not None:
        num_k_heads, stride_kt, stride_kh = _head_view("key", key, num_tokens, head_dim)
    else:
        num_k_heads, stride_kt, stride_kh = 1, 0, 0
    if num_tokens > 0:
        rot_half = cos_sin_cache.shape[1] // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key if key is not None else query,
            cos_sin_cache,
            stride_qt,
            stride_qh,
            stride_kt,
            stride_kh,
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_K_HEADS=num_k_heads,
            Q_HEADS_PAD=next_power_of_2(num_q_heads),
            K_HEADS_PAD=next_power_of_2(num_k_heads),
            ROT_HALF=rot_half,
            HALF_PAD=next_power_of_2(rot_half),
            HAS_KEY=key is not None,
            num_warps=4,
        )
    return query, key


__all__ = ["rotary_embedding"]
