"""When the layers route to the fused Triton kernels.

On a CUDA tensor, with Triton importable, the layers (RMSNorm with its residual add,
SiLU-and-mul, and, with the Triton attention backend, the QKV prologue: q/k norm + rotary +
K/V store in one kernel) call the Triton kernels of ``tidal_engine.kernels.triton``; everywhere else they keep their torch code, which is the
reference the CPU parity tests hold to HF. ``TIDAL_FUSED_KERNELS=0`` turns the routing off
(the benchmarks use it to measure what the kernels buy).
"""

from __future__ import annotations

import os

import torch

_enabled: bool | None = None


def fused_kernels_enabled() -> bool:
    """True unless ``TIDAL_FUSED_KERNELS=0`` or Triton can't be imported (read once)."""
    global _enabled
    if _enabled is None:
        wanted = os.environ.get("TIDAL_FUSED_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")
        if wanted:
            from tidal_engine.kernels.triton import triton_available

            wanted = triton_available()
        _enabled = wanted
    return _enabled


def use_fused(x: torch.Tensor) -> bool:
    """Route this call to a Triton kernel? Only CUDA tensors, and only when enabled."""
    return x.is_cuda and fused_kernels_enabled()


def reset_fused_kernels_cache() -> None:
    """Forget the cached decision (tests that flip the environment variable)."""
    global _enabled
    _enabled = None
