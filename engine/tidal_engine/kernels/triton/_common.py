"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1); tl.arange needs power-of-two extents."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not supported, expected one of {allowed}")


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: kernel workspaces that must start
    zeroed are made on an eager call, never inside a capture (whose memory only a replay fills)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# A KV cache may also be fp8 e4m3 (--kv-cache-dtype fp8): stored as x / scale, clamped to this.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
KV_CACHE_DTYPES: tuple[torch.dtype, ...] = FLOAT_DTYPES + (FP8_KV_DTYPE,)


# Programmatic dependent launch (Hopper and later). A decode step is a chain of small kernels;
# launched this way, a kernel's programs start while the kernel before it finishes, read what
# does not depend on it, and wait (griddepcontrol.wait) before reading anything an earlier kernel
# of the forward wrote. Read before the wait: weights, and the step's metadata (positions, slots,
# sequence lengths, query offsets), which the runner writes before the forward's first kernel, a
# plain launch (the embedding lookup) that starts only once they are written. Every kernel that
# takes ``PDL`` calls ``pdl_wait`` in every program before its first write and before it exits,
# so completion stays transitive along the chain. TIDAL_PDL=0 turns it off.
@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compiled_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device`` where Triton kernels run compiled there (inline PTX
    included); None on other devices and under the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch: compiled on a
    CUDA device of compute capability 9 or later, a Triton with grid dependency control, and
    TIDAL_PDL not ``0``."""
    if os.environ.get("TIDAL_PDL", "1") == "0" or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return (compiled_capability(device) or (0, 0)) >= (9, 0)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel's programs launch, then wait until the previous kernel has finished
    and its writes are visible. A no-op without ``PDL``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
