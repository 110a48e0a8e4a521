"""Paged causal attention over a mixed batch (prefill chunks and decodes in one launch).

Layout (see ``tidal_engine.layers.attention``): sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]``; they are the last ``q_len`` of its ``seq_len``
tokens, so query j sits at position ``seq_len - q_len + j`` and sees keys ``0..position``.
Keys/values live in ``kv_cache [2, num_blocks, block_size, Hkv, D]``; position p of
sequence i is in block ``block_tables[i, p // block_size]`` at offset ``p % block_size``.

Work split. The grid is ``(num_tiles, num_kv_heads)``. A program handles one *query tile*
of one sequence for one KV head: ``BLOCK_Q`` consecutive query tokens times the ``GROUP``
query heads that share that KV head, laid out as the ``BLOCK_M = BLOCK_Q * GROUP`` (padded)
rows of the tile. Folding the GQA group into the rows lets a decode (q_len 1) still fill a
tensor-core tile and read each K/V block once per KV head instead of once per query head.

Program id -> sequence. Sequence i is given the tile ids starting at
``query_start_loc[i] // BLOCK_Q + i``; this start is strictly increasing in i and leaves
each sequence at least ``ceil(q_len / BLOCK_Q)`` ids, so ``T // BLOCK_Q + num_seqs``
programs cover every batch and the kernel finds its sequence by a binary search over
``query_start_loc``. The grid then depends only on (T, num_seqs), with no host-side
per-step index array (and so it stays usable under CUDA-graph capture). Programs past
their sequence's last query return at once.

Softmax is the online (streaming) one in fp32, with exp2 and the scale folded into log2(e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import FLOAT_DTYPES, check_dtype, check_same_device, next_power_of_2

_LOG2E = 1.4426950408889634


# The batch size and the block-table width change every step: don't let Triton specialise
# on them (== 1, divisible by 16), or new steps would trigger fresh JIT compiles mid-run.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e): scores go straight into exp2
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # cache strides: block, slot within block, kv head (last dim contiguous)
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tile rows = (query token, head in group) pairs
    BLOCK_Q: tl.constexpr,  # query tokens per tile = BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest i with query_start_loc[i] // BLOCK_Q + i <= tile (see module docstring).
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        right = mid_start <= tile
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = lo - 1

    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_begin
    q_tile_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first query of the tile, within seq
    if q_tile_start >= q_len:
        return  # spare tile id of this sequence
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    row_q = q_tile_start + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (row_q < q_len)
    row_pos = ctx_len + row_q

    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    row_tok = (q_begin + row_q).to(tl.int64)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + row_tok[:, None] * stride_qt + row_head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    # A finite floor keeps alpha = exp2(m_old - m_new) at 1, not NaN, while a row has seen
    # only masked keys.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Keys up to the tile's last query position; the rest would be masked anyway.
    kv_end = ctx_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for start_n in range(0, kv_end, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < kv_end
        # Per-key gather through the block table: any block size works with any BLOCK_N.
        block_id = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_off = block_id * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head_off
        k_t = tl.load(
            k_cache_ptr + slot_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0
        )  # [D, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        visible = (k_pos[None, :] <= row_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + slot_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0
        )  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = row_tok[:, None] * stride_ot + row_head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def choose_tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int]:
    """Default (BLOCK_M, BLOCK_N): small M for decode-only batches (just the GQA group, >= 16
    for tl.dot), 64 rows once prefill chunks are present."""
    block_m = min(64, max(16, next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query [T, H, D]`` over ``kv_cache [2, blocks, block_size, Hkv, D]``.

    ``block_tables [S, max_blocks]`` (int32), ``seq_lens [S]`` (context length after this
    step) and ``query_start_loc [S+1]`` (cumulative query lengths) describe the batch; the
    cache must already hold this step's keys/values. ``max_query_len`` only picks tile
    sizes. Returns ``out [T, H, D]`` (allocated if not given) in query's dtype; rows past
    ``query_start_loc[-1]`` (padding) are left untouched. ``block_m``/``block_n`` override
    the tile sizes (powers of two, ``block_m >= H // Hkv``, both >= 16).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, kv_cache {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_dtype("query", query, FLOAT_DTYPES)
    if kv_cache.dtype != query.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be a 2-D int32/int64 tensor, got {block_tables.dtype} {tuple(block_tables.shape)}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"batch size mismatch: seq_lens {num_seqs}, query_start_loc {query_start_loc.shape[0]} (want S+1), "
            f"block_tables {block_tables.shape[0]}"
        )
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    check_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc)
    if query.stride(2) != 1:
        query = query.contiguous()
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache's last dim must be contiguous")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must match query's shape and dtype, with a contiguous last dim")
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    default_m, default_n = choose_tiles(max_query_len, group, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if block_m < group or block_m & (block_m - 1) or block_n & (block_n - 1) or min(block_m, block_n) < 16:
        raise ValueError(f"bad tiles block_m={block_m}, block_n={block_n} for GQA group {group}")
    block_q = block_m // group

    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        kv_cache[0],
        kv_cache[1],
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        # fp32 inputs: true fp32 products (tf32 would cost ~1e-3 accuracy); 16-bit: native.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if block_m * max(16, next_power_of_2(head_dim)) <= 64 * 128 else 8,
    )
    return out


__all__ = ["paged_attention", "choose_tiles"]
