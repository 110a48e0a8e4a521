"""Torch references of the non-attention kernels (any device, any dtype).

They define what the Triton kernels in ``tidal_engine.kernels.triton`` must compute, and
serve as the fallback when Triton is unavailable. The attention reference is
``TorchAttentionBackend`` in ``tidal_engine.layers.attention``.

Rounding follows Hugging Face's Llama/Qwen code where it matters: RMSNorm normalises in
fp32, rounds to the input dtype, then multiplies by the weight; a residual add is rounded
to the input dtype before it is normalised (so the normalised value equals the new
residual that the next layer sees).
"""

from __future__ import annotations

import torch

from tidal_engine.layers.kv_cache_dtype import byte_view, to_cache


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim, statistics in fp32."""
    xf = x.to(torch.float32)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((xf * inv_rms).to(x.dtype).to(torch.float32) * weight.to(torch.float32)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to x's dtype first."""
    new_residual = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]``, computed in fp32, one rounding."""
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    return (torch.nn.functional.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Plain (unscaled) RoPE table ``[max_position, rotary_dim]``: cos in the first half, sin in
    the second. Models with rope scaling build their own table in the same layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, 1, rotary_dim // 2] in fp32.
    half = rotary_dim // 2
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, xf[..., rotary_dim:]], dim=-1).to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Neox-style RoPE (rotate halves of the first ``rotary_dim`` dims; the rest pass through).

    ``query`` is ``[T, H * head_dim]`` or ``[T, H, head_dim]`` (same for ``key``);
    ``cos_sin_cache`` is ``[max_position, rotary_dim]`` (cos half, then sin half).
    Returns new tensors of the inputs' shapes; computed in fp32.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache[positions.long()].to(torch.float32)
    cos, sin = cs[:, None, : rotary_dim // 2], cs[:, None, rotary_dim // 2 :]
    q = _rotate_neox(query.reshape(query.shape[0], -1, head_dim), cos, sin, rotary_dim).reshape(query.shape)
    if key is None:
        return q, None
    k = _rotate_neox(key.reshape(key.shape[0], -1, head_dim), cos, sin, rotary_dim).reshape(key.shape)
    return q, k


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Scatter ``key/value [T, Hkv, D]`` into ``kv_cache [2, blocks, block_size, Hkv, D]`` at the
    flat slots ``slot_mapping [T]`` (-1: skip). Same as ``TorchAttentionBackend.write_kv``; an
    fp8 cache stores ``key / k_scale`` and ``value / v_scale`` (layers/kv_cache_dtype.py)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    keep = slot_mapping >= 0
    flat = byte_view(kv_cache).view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0, slot_mapping[keep]] = byte_view(to_cache(key[keep], k_scale, kv_cache.dtype))
    flat[1, slot_mapping[keep]] = byte_view(to_cache(value[keep], v_scale, kv_cache.dtype))


def qkv_prologue_ref(
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
    """The attention prologue of one layer: split ``qkv [T, (H + 2*Hkv) * D]`` into heads,
    RMS-normalise q and k per head (when the weights are given), rotate them (neox, fp32, one
    rounding), store k and v into ``kv_cache`` at ``slot_mapping`` (-1: skip) and return q
    ``[T, H, D]``. The composition of ``rms_norm_ref``, ``rotary_embedding_ref`` and
    ``write_kv_ref``, with the same rounding points."""
    num_tokens = qkv.shape[0]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_width : q_width + kv_width].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width :].reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k_rot = rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)
    assert k_rot is not None
    write_kv_ref(k_rot, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q.contiguous()
