"""Triton kernels (GPU; on CPU only under ``TRITON_INTERPRET=1``).

Nothing is imported here on purpose: ``import tidal_engine`` must keep working where Triton
is missing or no GPU exists. Import the submodules (``paged_attention``, ``kv_write``,
``rms_norm``, ``rotary``, ``activation``, ``qkv_prologue``, ``lora_sgmv``) when you need them, or use
``tidal_engine.kernels.triton_backend.TritonAttentionBackend``.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (says nothing about a GPU)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] set to None
        return False
