"""The KV cache's storage type (vLLM's ``--kv-cache-dtype``) and its per-layer scales.

``auto`` stores keys and values in the model's dtype. ``fp8`` (= ``fp8_e4m3``) stores them in
float8 e4m3 with one scale per tensor: each attention layer has a ``k_scale`` and a
``v_scale`` (1.0 unless the checkpoint gives them), the cache holds ``x / scale`` rounded to
e4m3 (clamped to its finite range, ±448) and readers multiply by the scale again. Half the
bytes per token, so the same memory holds twice the blocks, and decode reads half the KV.

This module is the torch reference of that rounding (the Triton kernels compute the same:
fp32 product with ``1 / scale``, clamp, round to nearest even), and it knows the names
checkpoints give the scales.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite e4m3fn value; larger inputs saturate instead of becoming NaN


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the cache for ``--kv-cache-dtype``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def check_scale(name: str, value: float) -> float:
    """A KV scale must be a positive finite number (it divides every stored value)."""
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def to_cache(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: unchanged but for the cast, or for fp8 ``x / scale``
    (an fp32 product with the fp32 reciprocal, as the kernels compute it), clamped, rounded."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.to(torch.float32) * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached keys or values back in fp32 (times the scale for an fp8 cache)."""
    out = x.to(torch.float32)
    return out * scale if is_fp8(x.dtype) else out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as raw bytes, for indexing (gather / index_put are not implemented for
    float8 on every device); any other tensor as it is. ``.view(dtype)`` turns it back."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


# Checkpoint names of the per-layer scales, after ``model.layers.<i>.``: what llm-compressor /
# compressed-tensors, AutoFP8, ModelOpt and vLLM's own saved models write. "kv" is the old
# single scale for both. q_scale/prob_scale (FP8 attention math) are read and ignored.
_SCALE_NAMES: dict[str, str] = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.kv_scale": "kv",
    "self_attn.attn.k_scale": "k",
    "self_attn.attn.v_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
    "self_attn.q_scale": "ignore",
    "self_attn.attn.q_scale": "ignore",
    "self_attn.prob_scale": "ignore",
    "self_attn.attn.prob_scale": "ignore",
}


def kv_scale_kind(layer_suffix: str) -> str | None:
    """``"k"``, ``"v"``, ``"kv"`` or ``"ignore"`` when ``layer_suffix`` (a checkpoint name after
    ``model.layers.<i>.``) is a KV-cache scale; None otherwise."""
    return _SCALE_NAMES.get(layer_suffix)


def scalar_scale(name: str, tensor: torch.Tensor) -> float:
    """A per-tensor scale from the checkpoint: one element (shape [] or [1])."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a per-tensor KV scale has one element, got shape {tuple(tensor.shape)}")
    return check_scale(name, float(tensor.reshape(()).to(torch.float32)))
