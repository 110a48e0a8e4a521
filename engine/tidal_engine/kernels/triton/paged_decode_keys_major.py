"""One-query paged decode with the keys as the MMA's M dimension ("roles swapped").

``paged_attention``'s kernel puts a decode's GQA group (4 query heads at the Qwen3-8B shape) on
the rows of its tiles: ``S = q @ K^T`` with M = the group padded to 16. Over an fp8 cache that
layout costs: an fp8 operand makes Triton (3.6) give both dot operands ``kWidth = 4``, which
``ldmatrix`` cannot load, so the loop-invariant query and the probabilities are rebuilt into MMA
fragments every key tile (sm_90 SASS: ~250 register moves and 32 ``LDS.64`` a 128-key tile).

Here the keys are the rows: ``S^T = K @ q^T`` (``[BLOCK_N, BLOCK_H]``, M = keys, N = the group
padded to ``BLOCK_H``), the softmax runs down the key axis (axis 0), and the output is
accumulated transposed, ``O^T += V^T @ P^T`` (``[HEAD_DIM, BLOCK_H]``). The widened K and V tiles
are the A operands (widened in registers, staged as fp16, read by ``ldmatrix``); q^T and P^T are
the B operands (wgmma reads them from shared memory; q^T is staged once). sm_90 SASS (Triton
3.6, 64-key tile, 4 warps, 128 registers): 469 instructions a thread per tile against 568 for the
rows kernel. The max down the key axis needs a reduction across the four warps each tile; the
sum does not: the probabilities are summed per key slot and reduced once at the end.
Same arithmetic as the other kernel otherwise: fp32
online softmax in log2 units, fp16 dots over an fp8 cache with a 16-bit query (the query clamped
to fp16's range), ``k_scale`` folded into ``scale_log2`` and ``v_scale`` applied to the output.

Only plain decodes: every sequence has at most one query (padding slots have none and return),
the query sits at position ``seq_len - 1`` and sees every cached key. Split-KV works as in
``paged_attention`` (the same scratch layout, merged by its ``combine_splits``).
"""

from __future__ import annotations

import triton
import triton.language as tl

_FP16_MAX = tl.constexpr(65504.0)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens", "num_splits"])
def _decode_keys_major_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,  # [num_splits, T, H, D] fp32; only when SPLIT
    partial_lse_ptr,  # [num_splits, T, H] fp32, log2 units; only when SPLIT
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
    v_scale,  # read only when KV_FP8
    num_seqs,
    num_tokens,
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # the group padded to a dot's N (>= 16)
    BLOCK_N: tl.constexpr,  # keys per iteration: the dots' M and K
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr,  # KV_FP8 with a 16-bit query: both dots in fp16
    OFFS_I32: tl.constexpr,
    BT_AHEAD: tl.constexpr,  # load each tile's block ids one iteration ahead
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_begin
    if q_len < 1:
        return  # a padding slot
    kv_end = tl.load(seq_lens_ptr + seq).to(tl.int32)  # the query is the last token: sees them all

    cols = tl.arange(0, BLOCK_H)
    col_head = kv_head * GROUP + cols
    col_valid = cols < GROUP
    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    tok = q_begin.to(tl.int64)

    kv_start = 0
    kv_stop = kv_end
    if SPLIT:
        split = tl.program_id(2)
        steps = (kv_end + BLOCK_N - 1) // BLOCK_N
        keys_per_split = (steps + num_splits - 1) // num_splits * BLOCK_N
        kv_start = split * keys_per_split
        kv_stop = tl.minimum(kv_start + keys_per_split, kv_end)
        p_col = (split.to(tl.int64) * num_tokens + tok) * num_heads + col_head
        if kv_start >= kv_stop:
            tl.store(partial_lse_ptr + p_col, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=col_valid)
            return

    qt_mask = d_valid[:, None] & col_valid[None, :]
    q_t = tl.load(q_ptr + tok * stride_qt + col_head[None, :] * stride_qh + d[:, None], mask=qt_mask, other=0.0)
    if DOT_F16:
        q_t = tl.clamp(q_t.to(tl.float32), -_FP16_MAX, _FP16_MAX).to(tl.float16)  # [D, BLOCK_H]

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    acc_t = tl.zeros([HEAD_DIM_PAD, BLOCK_H], tl.float32)
    l_2d = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if OFFS_I32:
        kv_head_off = kv_head * stride_ch
    else:
        kv_head_off = kv_head.to(tl.int64) * stride_ch
    if BT_AHEAD:
        # Block ids a tile ahead: a tile's K/V gather never waits on a block-table load of its
        # own iteration, and the pipeliner can keep two tiles in flight (num_stages=3).
        k_pos0 = kv_start + offs_n
        block_next = tl.load(bt_row + k_pos0.to(tl.uint32) // BLOCK_SIZE, mask=k_pos0 < kv_stop, other=0)
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < kv_stop
        if BT_AHEAD:
            block_id = block_next
            k_pos_next = k_pos + BLOCK_N
            block_next = tl.load(bt_row + k_pos_next.to(tl.uint32) // BLOCK_SIZE, mask=k_pos_next < kv_stop, other=0)
        else:
            block_id = tl.load(bt_row + k_pos.to(tl.uint32) // BLOCK_SIZE, mask=k_valid, other=0)
        slot = k_pos.to(tl.uint32) % BLOCK_SIZE
        if OFFS_I32:
            slot_off = block_id.to(tl.int32) * stride_cb + slot.to(tl.int32) * stride_cs + kv_head_off
        else:
            slot_off = block_id.to(tl.int64) * stride_cb + slot.to(tl.int64) * stride_cs + kv_head_off
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + slot_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        if KV_FP8:
            # Widened before staging (pinned there by the product with a per-key tensor, as V
            # below): K reaches the MMA from 16-bit shared memory by ldmatrix. Widened after,
            # its A fragments were gathered two bytes at a time (sm_90 SASS, 64-key tile: 32
            # LDS.U16; 650 instructions a thread per tile against 524 pinned).
            k = k.to(q_t.dtype) * k_valid[:, None].to(q_t.dtype)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_N, BLOCK_H]
        s_t = tl.where(k_valid[:, None], s_t, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        # The row sums stay per key slot until the end: one reduction across the warps (the
        # max) per tile instead of two (SASS: 524 -> 469 instructions a tile).
        l_2d = l_2d * alpha[None, :] + p_t
        v = tl.load(v_cache_ptr + slot_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        if KV_FP8:
            # Widened before the transpose, and pinned there by a product with a per-key tensor
            # (0 past the end, where the load gave 0 anyway): staged as 16-bit, V^T reaches the
            # MMA by ldmatrix. Transposed as fp8, the A fragments were gathered a byte or two at
            # a time (sm_90 SASS, 64-key tile: 64 LDS.U8, or 80 PRMT and 32 LDS.U16).
            v = v.to(q_t.dtype) * k_valid[:, None].to(q_t.dtype)
        v_t = tl.trans(v)  # [D, BLOCK_N]
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_t.to(v_t.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.sum(l_2d, axis=0)
    seen = l_i > 0.0
    acc_t = acc_t / tl.where(seen, l_i, 1.0)[None, :]
    if KV_FP8:
        acc_t = acc_t * v_scale
    o_mask = qt_mask
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + p_col, lse, mask=col_valid)
        tl.store(partial_out_ptr + p_col[None, :] * HEAD_DIM + d[:, None], acc_t, mask=o_mask & seen[None, :])
    else:
        o_off = tok * stride_ot + col_head[None, :] * stride_oh + d[:, None]
        tl.store(out_ptr + o_off, acc_t.to(out_ptr.dtype.element_ty), mask=o_mask)
