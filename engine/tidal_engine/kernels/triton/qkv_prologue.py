"""The attention prologue in one launch: per-head q/k RMSNorm, rotary, and the KV-cache store.

Between the fused QKV GEMM and the attention kernel a decoder layer used to launch up to five
small kernels (q-norm, k-norm, rotary, a copy of v, the KV scatter). Inside a CUDA graph on a
fast GPU each costs a few microseconds, which across a model's layers is a real share of a
decode step. This kernel does all of it, reading q, k and v straight from the (possibly
strided) QKV output.

Numerics are those of the separate Triton kernels run in sequence (``rms_norm_heads`` →
``rotary_embedding`` → ``write_kv``), rounding point for rounding point: the norm's statistics
use the same ``[heads, head_dim]`` tile and reduction, its result is rounded to the model dtype
before and after the weight, the rotation runs in fp32 on those rounded values and is rounded
once, and k is rounded to the model dtype before it is cast to the cache's dtype (for an fp8
cache: divided by the layer's k_scale, clamped and rounded, as ``write_kv`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    KV_CACHE_DTYPES,
    check_dtype,
    check_same_device,
    next_power_of_2,
    pdl_launch,
    pdl_wait,
)
from tidal_engine.kernels.triton.kv_write import to_cache_value


@triton.jit
def _norm_rope_heads(
    x_ptr,
    w_ptr,
    eps,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """The heads ``x_ptr[h * HEAD_DIM + d]`` of one token, optionally RMS-normalised, then
    rotated; returns the two rotated halves ``[HEADS_PAD, HALF_PAD]`` in x's dtype."""
    dt = x_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    half_mask = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
    p1 = x_ptr + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(p1, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=half_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # Statistics from the whole [heads, head_dim] tile, as rms_norm_heads computes them (a
        # sum over the two halves would add in another order and could differ in the last bit).
        # The second read of the same bytes comes from L1.
        d = tl.arange(0, DIM_PAD)
        full_mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        x = tl.load(x_ptr + h[:, None] * HEAD_DIM + d[None, :], mask=full_mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        # HF's order: normalise in fp32, round, scale by the weight, round (what the unfused
        # path stores and the rotary kernel then reads back).
        x1 = ((x1 * inv_rms).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # Neox rotary, the same expressions as the rotary kernel: (x1 cos - x2 sin, x2 cos + x1 sin).
    return (x1 * cos - x2 * sin).to(dt), (x2 * cos + x1 * sin).to(dt)


@triton.jit
def _qkv_prologue_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_w_ptr,
    k_norm_w_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    inv_k_scale,  # 1 / k_scale, 1 / v_scale: read only when FP8
    inv_v_scale,
    stride_qkv_t,
    stride_cs,
    stride_cb,
    stride_cslot,
    stride_ch,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Two programs per token, q's heads and k/v's heads (in parallel: a decode step has a
    # single token); the grid depends on the token count alone, so a CUDA graph captured for
    # T tokens replays for any batch padded to T.
    tok = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    # The step's positions and slots (written before the forward's first kernel) and the rotary
    # table are read while the kernel before this one finishes; qkv and the cache wait for it.
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    cs_row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(cs_row + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    pdl_wait(PDL)
    row = qkv_ptr + tok * stride_qkv_t

    if part == 0:
        # q: every token gets its row, padding included (the rest of the layer is row-wise).
        q1, q2 = _norm_rope_heads(
            row, q_norm_w_ptr, eps, cos, sin, NUM_HEADS, HEADS_PAD, HEAD_DIM, DIM_PAD, HALF, HALF_PAD, HAS_NORM
        )
        h = tl.arange(0, HEADS_PAD)
        q_mask = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
        q_dst = q_out_ptr + tok * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + j[None, :]
        tl.store(q_dst, q1, mask=q_mask)
        tl.store(q_dst + HALF, q2, mask=q_mask)
        return

    # k and v only matter where they are stored; slot < 0 (padding) stores nothing.
    if slot >= 0:
        k1, k2 = _norm_rope_heads(
            row + NUM_HEADS * HEAD_DIM, k_norm_w_ptr, eps, cos, sin,
            NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, DIM_PAD, HALF, HALF_PAD, HAS_NORM,
        )
        hk = tl.arange(0, KV_HEADS_PAD)
        base = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cslot
        k_mask = (hk < NUM_KV_HEADS)[:, None] & (j < HALF)[None, :]
        k_dst = k_cache_ptr + base + hk[:, None] * stride_ch + j[None, :]
        # k was already rounded to the model dtype; this cast only matters for another cache dtype.
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(k_dst, to_cache_value(k1, inv_k_scale, cache_ty, FP8), mask=k_mask)
        tl.store(k_dst + HALF, to_cache_value(k2, inv_k_scale, cache_ty, FP8), mask=k_mask)
        d = tl.arange(0, DIM_PAD)
        v_mask = (hk < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        v_src = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + hk[:, None] * HEAD_DIM + d[None, :]
        v = tl.load(v_src, mask=v_mask)
        v_dst = v_cache_ptr + base + hk[:, None] * stride_ch + d[None, :]
        tl.store(v_dst, to_cache_value(v, inv_v_scale, v_cache_ptr.dtype.element_ty, FP8), mask=v_mask)


def qkv_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Everything between the QKV projection and attention, in one launch.

    ``qkv [T, (H + 2*Hkv) * D]`` is the projection's output (q heads, then k, then v; any token
    stride, contiguous last dim, e.g. a slice of a wider buffer). For each token t, with
    ``cos_sin_cache [max_position, D]`` (fp32; cos half, then sin half) at row ``positions[t]``:

    - q and k are, per head, RMS-normalised with ``q_norm_weight`` / ``k_norm_weight [D]``
      (both given, or both None for no norm; one ``eps`` for both, as the models build them),
      then rotated neox-style (halves) in fp32 and rounded to qkv's dtype;
    - k (normed, rotated) and v (as is) go to ``kv_cache [2, num_blocks, block_size, Hkv, D]``
      at flat slot ``slot_mapping[t]`` (cast to the cache's dtype; an fp8 cache stores
      ``k / k_scale`` and ``v / v_scale``); slots < 0 store nothing.

    Returns q as a new contiguous ``[T, H, D]`` in qkv's dtype, one row for every token (slot
    -1 padding too). Same numbers as ``rms_norm_heads`` → ``rotary_embedding`` → ``write_kv``;
    matches ``kernels.reference.qkv_prologue_ref``.
    """
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != qkv_width:
        raise ValueError(f"qkv must be [T, {qkv_width}] = [T, (H + 2*Hkv) * D], got {tuple(qkv.shape)}")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for neox rotary, got {head_dim}")
    num_tokens = qkv.shape[0]
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.dim() != 1 or idx.shape[0] != num_tokens or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a [{num_tokens}] int32/int64 tensor, got {idx.dtype} {tuple(idx.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        # The layers always rotate the whole head; partial rotary stays on rotary_embedding.
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache's last dim must be contiguous")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    has_norm = q_norm_weight is not None and k_norm_weight is not None
    for name, t in (("qkv", qkv), ("cos_sin_cache", cos_sin_cache)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_dtype("kv_cache", kv_cache, KV_CACHE_DTYPES)
    tensors = dict(
        qkv=qkv, positions=positions, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache, slot_mapping=slot_mapping
    )
    if has_norm:
        assert q_norm_weight is not None and k_norm_weight is not None
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w.dim() != 1 or w.shape[0] != head_dim:
                raise ValueError(f"{name} must be [{head_dim}], got {tuple(w.shape)}")
            check_dtype(name, w, FLOAT_DTYPES)
        tensors.update(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    check_same_device(**tensors)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    q_norm_weight = q_norm_weight.contiguous() if q_norm_weight is not None else None
    k_norm_weight = k_norm_weight.contiguous() if k_norm_weight is not None else None

    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    # No per-step scalar reaches the kernel (the token count is the grid alone; strides and
    # eps are fixed per model), so nothing needs do_not_specialize and a captured graph never
    # triggers a recompile.
    pdl = pdl_launch(qkv.device)
    _qkv_prologue_kernel[(num_tokens, 2)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if q_norm_weight is not None else cos_sin_cache,  # unused when HAS_NORM=False
        k_norm_weight if k_norm_weight is not None else cos_sin_cache,
        q,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        DIM_PAD=next_power_of_2(head_dim),
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_NORM=has_norm,
        FP8=kv_cache.dtype == FP8_KV_DTYPE,
        PDL=pdl,
        num_warps=4,  # as the separate kernels: same tile layouts, so the same reduction order
        launch_pdl=pdl,
    )
    return q


__all__ = ["qkv_prologue"]
