"""Attention over a packed batch with no KV cache: the prefill-only path of pooling models.

Pooling requests run one forward over their whole prompt and keep nothing afterwards, so
keys and values never leave the step. Tokens arrive packed (``[T, heads, head_dim]``,
request i owning ``cu_seqlens[i]:cu_seqlens[i+1]``); SDPA wants a padded ``[B, H, L, D]``
batch, so we pad, attend with a key-padding (and, for decoders, causal) mask, and unpad.
A batch of equal lengths skips the padding and the mask, which lets SDPA pick its flash
kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], causal: bool, scale: float
) -> torch.Tensor:
    """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` packed by ``seq_lens`` → ``[T, H, D]``."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    batch, longest = len(seq_lens), max(seq_lens)
    if all(n == longest for n in seq_lens):
        def batched(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, longest, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            batched(q), batched(k), batched(v), is_causal=causal, scale=scale, enable_gqa=gqa
        )
        return out.transpose(1, 2).reshape(q.shape)
    index = padded_index(seq_lens, q.device)

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(batch * longest, x.shape[1], x.shape[2])
        out[index] = x
        return out.view(batch, longest, x.shape[1], x.shape[2]).transpose(1, 2)

    lens = torch.tensor(seq_lens, device=q.device)
    positions = torch.arange(longest, device=q.device)
    mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]: real keys
    if causal:
        mask = mask & (positions[None, :] <= positions[:, None])[None, None]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(batch * longest, num_heads, q.shape[2])[index]


def padded_index(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """Flat row of each packed token in the padded ``[B * max_len]`` layout."""
    longest = max(seq_lens)
    return torch.cat([torch.arange(n, device=device) + i * longest for i, n in enumerate(seq_lens)])


def packed_qkv_attention(qkv: torch.Tensor, num_heads: int, seq_lens: list[int], scale: float) -> torch.Tensor:
    """Bidirectional multi-head attention straight from a packed QKV projection ``[T, 3*H*D]``
    (q, k, v stacked, as QKVLinear makes them) → ``[T, H*D]``. One padding copy for all three
    instead of one each: the encoder's cheaper path."""
    tokens, width = qkv.shape
    head_dim = width // (3 * num_heads)
    batch, longest = len(seq_lens), max(seq_lens)
    equal = all(n == longest for n in seq_lens)
    index = None if equal else padded_index(seq_lens, qkv.device)
    if index is None:
        padded = qkv
    else:
        padded = qkv.new_zeros(batch * longest, width)
        padded[index] = qkv
    q, k, v = padded.view(batch, longest, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    mask = None
    if index is not None:
        lens = torch.tensor(seq_lens, device=qkv.device)
        mask = (torch.arange(longest, device=qkv.device)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(batch * longest, num_heads * head_dim)
    return out if index is None else out[index]
