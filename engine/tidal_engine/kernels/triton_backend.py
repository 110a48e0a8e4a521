"""``TritonAttentionBackend``: the AttentionBackend protocol on the Triton kernels.

Importing this module does not import Triton; the kernels are loaded on first use (or by
the constructor), so the engine can name the class on machines without Triton or a GPU.
On CPU the kernels only run with ``TRITON_INTERPRET=1`` set before they are first loaded.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tidal_engine.layers.attention import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention for mixed prefill/decode batches in one launch, plus the KV scatter."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None) -> None:
        # Tile overrides (tests, tuning); None picks per batch (see paged_attention.choose_tiles).
        self.block_m = block_m
        self.block_n = block_n
        self._attn: ModuleType | None = None
        self._kv: ModuleType | None = None
        self._load()

    def _load(self) -> None:
        # Import here, not at module level: `import triton` fails where it isn't installed.
        from tidal_engine.kernels.triton import kv_write, paged_attention

        self._attn = paged_attention
        self._kv = kv_write

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Store ``key/value [T, Hkv, D]`` into their slots of ``kv_cache`` (slot -1: skip); an
        fp8 cache stores them divided by the layer's scales."""
        assert self._kv is not None
        self._kv.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of ``query [T, H, D]`` over the paged cache (already holding this
        step's K/V); returns ``[T, H, D]`` in query's dtype."""
        assert self._attn is not None
        return self._attn.paged_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            block_m=self.block_m,
            block_n=self.block_n,
            k_scale=k_scale,
            v_scale=v_scale,
        )


__all__ = ["TritonAttentionBackend"]
