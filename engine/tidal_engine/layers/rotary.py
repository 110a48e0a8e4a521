"""Rotary position embedding, neox style (rotate halves), as HF Llama/Qwen apply it.

cos/sin for every position up to ``max_position`` are computed once, in float32, and
looked up by each token's position, so a token's rotation does not depend on how the
batch around it was chunked.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tidal_engine.kernels.fused import use_fused


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by ``factor``, keep high ones, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(rotary_dim, base)
    rope_type = None if scaling is None else scaling.get("rope_type", "default")
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return x * cos + rotated_half * sin


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        target = torch.get_default_device()  # honours an enclosing ``with torch.device(...)``
        # Computed on the CPU whatever the target, so every device gets the same bits as HF.
        with torch.device("cpu"):
            inv_freq = compute_inv_freq(head_dim, base, scaling)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        # float32 whatever the model dtype: load_model never casts buffers.
        self.register_buffer("cos_cache", freqs.cos().repeat(1, 2).to(target), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().repeat(1, 2).to(target), persistent=False)
        # The Triton kernel's table: [max_position, head_dim] = cos half, then sin half (float32).
        # Only built for CUDA models, the only place the kernel runs.
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(target) if target.type == "cuda" else None
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query ``[T, H*D]`` / key ``[T, Hkv*D]`` (or already ``[T, heads, D]``) → rotated, same shapes."""
        if self.cos_sin_cache is not None and use_fused(query):
            # One Triton kernel for q and k, in place (the model passes fresh tensors), in fp32.
            from tidal_engine.kernels.triton.rotary import rotary_embedding

            return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim, inplace=True)  # type: ignore[return-value]
        # HF casts cos/sin to the activation dtype and rotates in that dtype; so do we.
        cos = self.cos_cache[positions].to(query.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cache[positions].to(query.dtype).unsqueeze(1)
        q = query.view(query.shape[0], -1, self.head_dim)
        k = key.view(key.shape[0], -1, self.head_dim)
        return _rotate_neox(q, cos, sin).view_as(query), _rotate_neox(k, cos, sin).view_as(key)
