"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import torch


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1); tl.arange needs power-of-two extents."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not supported, expected one of {allowed}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# A KV cache may also be fp8 e4m3 (--kv-cache-dtype fp8): stored as x / scale, clamped to this.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
KV_CACHE_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + (FP8_KV_DTYPE,)
