"""Paged attention: the metadata of one flattened batch, and the backend interface.

A step's batch is a flat run of tokens from several requests (prefill chunks and
decodes together). Request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``;
those are the *last* ``query_len`` tokens of its ``seq_len``-token context, so
query token j of request i sits at position ``seq_len - query_len + j`` and may
attend to keys at positions ``0..that position``.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (keys, then values). Token position p of request i is stored in block
``block_tables[i, p // block_size]`` at offset ``p % block_size``; ``slot_mapping``
gives each new token's flat slot ``block * block_size + offset`` (-1: don't store).
An fp8 cache (``--kv-cache-dtype fp8``) holds ``k / k_scale`` and ``v / v_scale`` in e4m3
(layers/kv_cache_dtype.py); every backend takes the layer's two scales and ignores them for
any other cache dtype.

Backends: ``TorchAttentionBackend`` (the reference, any device) and the Triton one
in ``tidal_engine.kernels.triton`` (GPU), chosen once at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tidal_engine.layers.kv_cache_dtype import byte_view, from_cache, to_cache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference code never syncs with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal attention of ``query [num_tokens, num_heads, head_dim]`` over the paged cache
        (which already holds this step's keys and values). Returns the same shape as query."""


class TorchAttentionBackend:
    """Reference backend: gathers each request's context from the block table, then SDPA."""

    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        flat = byte_view(kv_cache).view(2, num_blocks * block_size, *kv_cache.shape[3:])
        flat[0, slots] = byte_view(to_cache(key[keep], k_scale, kv_cache.dtype))
        flat[1, slots] = byte_view(to_cache(value[keep], v_scale, kv_cache.dtype))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(query, kv_cache, meta, scale, k_scale, v_scale)
        block_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q = query[starts[i] : starts[i + 1]]  # [q_len, H, D]
            q_len = q.shape[0]
            if q_len == 0:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[i, :num_blocks].long()
            k = byte_view(kv_cache)[0, blocks].view(kv_cache.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
            v = byte_view(kv_cache)[1, blocks].view(kv_cache.dtype).reshape(-1, num_kv_heads, head_dim)[:seq_len]
            # Query j sits at position seq_len - q_len + j and sees keys up to there.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).to(torch.float32),
                from_cache(k, k_scale).transpose(0, 1),
                from_cache(v, v_scale).transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[starts[i] : starts[i + 1]] = attn.transpose(0, 1).to(query.dtype)
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """One query per sequence: gather every context at once and attend in one batched op,
        grouping the query heads that share a KV head (no copies for GQA)."""
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        width = (meta.max_seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[:, :width].long()
        shape = (num_seqs, width * block_size, num_kv_heads, head_dim)
        k = from_cache(byte_view(kv_cache)[0, blocks].view(kv_cache.dtype).reshape(shape), k_scale)
        v = from_cache(byte_view(kv_cache)[1, blocks].view(kv_cache.dtype).reshape(shape), v_scale)
        valid = torch.arange(width * block_size, device=query.device)[None, :] < meta.seq_lens[:, None]
        # Padding slots may hold anything (even NaN). Masking the scores covers the keys; the
        # values need zeros so the masked weights (exact zeros) keep the sum finite.
        v = v.masked_fill(~valid[:, :, None, None], 0.0)
        q = query.view(num_seqs, num_kv_heads, group, head_dim).float()
        scores = torch.einsum("skgd,sjkd->skgj", q, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("skgj,sjkd->skgd", probs, v)
        return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


class Attention(nn.Module):
    """The attention op of one layer: store this step's K/V, then attend over the cache.

    ``forward`` does both; ``forward_prepared`` only attends, for callers that have already
    stored K/V themselves (the fused QKV prologue of the Triton path). ``k_scale``/``v_scale``
    are the layer's fp8 KV scales (1.0 unless the checkpoint gives them; unused by other caches).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] → [T, H*D]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.forward(q, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def forward_prepared(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention alone: ``kv_cache`` already holds this step's K/V. q: [T, H, D] or [T, H*D] → [T, H*D]."""
        out = self.backend.forward(
            q.view(-1, self.num_heads, self.head_dim), kv_cache, meta, self.scale, self.k_scale, self.v_scale
        )
        return out.reshape(-1, self.num_heads * self.head_dim)


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Choose the backend once, at start-up, for every attention layer of a model."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
