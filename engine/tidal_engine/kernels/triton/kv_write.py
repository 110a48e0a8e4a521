"""Scatter of this step's keys/values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    KV_CACHE_DTYPES,
    check_dtype,
    check_same_device,
    next_power_of_2,
)

FP8_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def to_cache_value(x, inv_scale, cache_ty: tl.constexpr, FP8: tl.constexpr):
    """``x`` as the cache stores it: a plain cast, or for fp8 ``x * (1 / scale)`` in fp32,
    clamped to the finite e4m3 range and rounded (layers/kv_cache_dtype.to_cache)."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(cache_ty)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    inv_k_scale,  # 1 / k_scale, 1 / v_scale: read only when FP8
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per token moves all its heads: [Hkv, D] is small, and one slot lookup serves all.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # -1: a token whose K/V must not be stored (e.g. padding)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, to_cache_value(k, inv_k_scale, k_cache_ptr.dtype.element_ty, FP8), mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, to_cache_value(v, inv_v_scale, v_cache_ptr.dtype.element_ty, FP8), mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store ``key/value [T, Hkv, D]`` into ``kv_cache [2, num_blocks, block_size, Hkv, D]`` in place:
    token t goes to flat slot ``slot_mapping[t]`` (block ``slot // block_size``, offset
    ``slot % block_size``); slots < 0 are skipped. Values are cast to the cache's dtype.
    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output). An fp8
    (e4m3fn) cache stores ``key / k_scale`` and ``value / v_scale``, clamped to ±448."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_dtype("kv_cache", kv_cache, KV_CACHE_DTYPES)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache's last dim must be contiguous")
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        FP8=kv_cache.dtype == FP8_KV_DTYPE,
        num_warps=4,
    )


__all__ = ["write_kv"]
