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
their sequence's last query return at once. A decode launch skips the search: program i
serves sequence i, and the grid is ``num_seqs``. That holds whenever every query fits one
tile (``max_query_len <= BLOCK_Q``): plain decodes (one query each) and the multi-query
decode rows of speculative decoding's verify steps (``k + 1`` queries each: the known last
token and the drafts, causal among themselves), which then cost one decode program per row
and KV head instead of a search and spare tiles.

Split-KV ("flash-decoding"). A small batch gives few programs (one decode of 8 KV heads:
8), each walking its whole context serially. With ``num_splits > 1`` the grid gains a third
dimension: program ``(tile, kv_head, split)`` cuts the keys its tile needs, ``[0, kv_end)``,
into ``num_splits`` contiguous BLOCK_N-aligned parts, chosen in the kernel from seq_lens, and
handles only its part. It writes the normalised partial output and its log-sum-exp (log2
units) to fp32 scratch ``partial_out [num_splits, T, H, D]`` / ``partial_lse [num_splits, T, H]``;
a row that sees no key of its part (an empty part, or a causal row before it) writes
``lse = -inf`` and no output. A second kernel then combines the parts of each (token, head):
weights ``exp2(lse - max lse)``, so empty parts weigh exactly 0 and their output is never
read. ``num_splits`` is chosen on the host from static facts only (batch size, KV heads,
query lengths: see ``choose_num_splits``), never from device values, since one captured CUDA
graph replays the same launch for every context length; any value computes any batch.
With ``num_splits == 1`` the first kernel writes ``out`` directly: no scratch, no reduce.

Softmax is the online (streaming) one in fp32, with exp2 and the scale folded into log2(e).

An fp8 cache (e4m3fn, ``--kv-cache-dtype fp8``) holds ``k / k_scale`` and ``v / v_scale``: K/V
tiles are widened in registers (the point is reading half the bytes), ``k_scale`` is folded
into the softmax scale and ``v_scale`` multiplies the output, so the loop only widens. With a
16-bit query both dots run in fp16 (the query, clamped to fp16's range, and the
probabilities are rounded to fp16, which carries more mantissa than bf16): on Hopper e4m3
widens to fp16 in one instruction per pair, exactly, while bf16 takes a second conversion
per element at a quarter of the ALU rate, which bounded the loop (an H200 read an fp8 cache at
1.95 TB/s that way, against 4.27 for a bf16 one). An fp32 query widens to fp32. A one-query decode
over an fp8 cache may load each key tile's block ids an iteration ahead (``bt_ahead``, with three
stages: two K/V tiles in flight per program), widen V by inline PTX (``v_ptx``) and keep the
softmax row sums per key slot (``slot_sums``); ``choose_fp8_decode`` picks (``FP8_DECODE_PRESETS``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    check_dtype,
    check_same_device,
    compiled_capability,
    next_power_of_2,
    pdl_launch,
    pdl_wait,
)

_LOG2E = 1.4426950408889634
_FP16_MAX = tl.constexpr(65504.0)

# Most KV splits per launch. The combine kernel loads every split's lse at once in a block of
# this (fixed) size, so the split count stays a runtime value and never forces a recompile.
MAX_SPLITS = 32
# Fewest keys worth a split of their own, when a max_seq_len hint is given.
_MIN_KEYS_PER_SPLIT = 64
# Register cap of the one-query decode launch (64-key tiles in two stages): 128 per thread
# leaves 4 programs of 4 warps per SM (sm_90: 119 bf16 / 135 fp8 uncapped locally, no spills at
# 128), so a batch of 64 x 8 KV heads runs in one wave of 132 SMs. On the H200, Qwen3-8B shape,
# per layer (benchmarks/results/h200-2026-12-01e-attn): bf16 64 x 8k 494 us against 557 with
# 128-key tiles, 256 x 320 103 against 109; fp8 64 x 8k 434 against 457 for the previous two
# splits of 128 keys. Uncapped, the same 64-key tiles took 500 / 136 us (bf16), 702 us (fp8).
_DECODE_MAXNREG = 128

# Launch presets of the fp8 one-query decode, by name. "rows": two stages (one K/V tile in flight,
# its copy issued after the previous tile's math and behind a block-table load of the same
# iteration); "rows_bt": each tile's block ids loaded an iteration ahead and three stages, so
# two tiles are in flight; "rows_bt_v_ss": rows_bt with V widened by inline PTX (_widen_e4m3_ptx:
# no pinning product, 620 -> 468 SASS instructions a 64-key tile on sm_90) and the softmax row
# sums kept per key slot (one reduction across warps a tile instead of two). H200, Qwen3-8B shape,
# one layer at 64 x 8k / the captured 64 x 8k step: rows 432 us / 20.50 ms and rows_bt 399 us /
# 18.86 ms (benchmarks/results/h200-2026-12-01g-kvfp8); rows_bt 400 us / 18.75 ms and
# rows_bt_v_ss 319 us / 15.85 ms (h200-2026-12-02-kvfp8u, programmatic dependent launch on; V by
# PTX alone 337 us, the slot sums alone 383 us; an L2 prefetch of the K/V rows 2-4 tiles ahead
# gained at most 2% of the kernel and nothing in the step, and was not kept). (A keys-major
# kernel, S^T = K q^T on wgmma, measured in g-kvfp8 at 419 us / 19.59 ms, was not kept either.)
# At 256 x 320 (four waves of programs, 5 tiles each) g-kvfp8 could not rank them (the rows
# launch itself read 95 and 158 us as two settings; rows_bt 122): there, and for split launches
# (short walks), the rows launch stays until measured.
FP8_DECODE_PRESETS: dict[str, dict[str, object]] = {
    "rows": {},
    "rows_bt": {"bt_ahead": True, "num_stages": 3},
    "rows_bt_v_ss": {"bt_ahead": True, "num_stages": 3, "v_ptx": True, "slot_sums": True},
}
# Programs per SM of the decode launch (_DECODE_MAXNREG): "rows_bt_v_ss" while one wave holds them all.
_DECODE_PROGRAMS_PER_SM = 4


def choose_fp8_decode(num_seqs: int, num_kv_heads: int, num_splits: int, num_sms: int) -> str:
    """The fp8 one-query decode preset from static launch facts: ``TIDAL_FP8_DECODE`` when set
    (an unknown name is an error, not a silent fallback), else "rows_bt_v_ss" for an unsplit
    launch that fits one wave (each program walks a whole context: keeping two tiles in flight
    pays, and the leaner loop; measured at 64 x 8k), "rows" otherwise (splits, or several waves of
    programs: not shown to gain)."""
    name = os.environ.get("TIDAL_FP8_DECODE")
    if name is None:
        one_wave = num_seqs * num_kv_heads <= _DECODE_PROGRAMS_PER_SM * num_sms
        return "rows_bt_v_ss" if num_splits == 1 and one_wave else "rows"
    if name not in FP8_DECODE_PRESETS:
        raise ValueError(f"TIDAL_FP8_DECODE={name!r}: expected one of {sorted(FP8_DECODE_PRESETS)}")
    return name


@triton.jit
def _block_ids(bt_row, k_pos, valid, BLOCK_SIZE: tl.constexpr, OFFS_I32: tl.constexpr):
    """Cache block of each key position (0 where not ``valid``). Positions are never negative:
    unsigned, ``//`` and ``%`` by a power-of-two block size are one shift or mask each."""
    block_id = tl.load(bt_row + k_pos.to(tl.uint32) // BLOCK_SIZE, mask=valid, other=0)
    if OFFS_I32:
        return block_id.to(tl.int32)
    else:
        return block_id.to(tl.int64)


@triton.jit
def _slot_offsets(block_id, k_pos, stride_cb, stride_cs, kv_head_off, BLOCK_SIZE: tl.constexpr,
                  OFFS_I32: tl.constexpr):
    """Element offset of each key's head vector in one half (K or V) of the cache."""
    slot = k_pos.to(tl.uint32) % BLOCK_SIZE
    if OFFS_I32:
        return block_id * stride_cb + slot.to(tl.int32) * stride_cs + kv_head_off
    else:
        return block_id * stride_cb + slot.to(tl.int64) * stride_cs + kv_head_off


@triton.jit
def _widen_e4m3_ptx(x):
    """e4m3 -> fp16, four at a time with sm_89+'s paired conversion (the instruction Triton's own
    cast uses), as inline PTX with side effects: Triton keeps it where it is written, before V's
    staging for the dot, with no pinning product. The rows_bt loop around it came out 620 -> 468
    SASS instructions a 64-key tile (sm_90, Triton 3.6: 144 -> 64 register moves, no HMUL2)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tile(q, k_t, v, k_pos, kv_stop, row_pos, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr,
                 KV_FP8: tl.constexpr, SLOT_SUMS: tl.constexpr = False, V_PTX: tl.constexpr = False):
    """One key tile of the online softmax: ``k_t [D, BLOCK_N]`` and ``v [BLOCK_N, D]`` (cache dtype)
    at positions ``k_pos``; keys at or past ``kv_stop`` or after a row's position are masked.
    ``SLOT_SUMS``: ``l_i`` is ``[BLOCK_M, BLOCK_N]``, each row's sum per key slot
    (summed once after the loop), so a tile adds no reduction across warps for it. ``V_PTX``
    (fp8 cache, fp16 dots): V is widened by ``_widen_e4m3_ptx``."""
    k_valid = k_pos < kv_stop
    if KV_FP8:
        k_t = k_t.to(q.dtype)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
    visible = (k_pos[None, :] <= row_pos[:, None]) & k_valid[None, :]
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if SLOT_SUMS:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FP8:
        # Widened before V is staged in shared memory for the dot, where Triton would otherwise
        # move the cast (after the staging, the dot gathers V's key-strided bytes with one
        # shared load per byte: sm_90 SASS, 128 LDS.U8 per thread and 128-key tile); staged as
        # 16-bit, V is read by transposing ldmatrix, as a bf16 cache is. Pinned either by the
        # inline PTX (which Triton never moves) or by a product with a per-key tensor (0 for
        # keys past the end, whose loads are 0 anyway).
        if V_PTX:
            v = _widen_e4m3_ptx(v)
        else:
            v = v.to(q.dtype) * k_valid[:, None].to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# The batch size, the block-table width, the token count and the split count change from
# step to step: don't let Triton specialise on them (== 1, divisible by 16), or new steps
# would trigger fresh JIT compiles mid-run.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens", "num_splits"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_out_ptr,  # [num_splits, T, H, D] fp32; only read when SPLIT
    partial_lse_ptr,  # [num_splits, T, H] fp32, log2 units; only read when SPLIT
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an fp8 cache): scores go straight into exp2
    v_scale,  # read only when KV_FP8
    num_seqs,
    num_tokens,  # T, the rows of query / out / the scratch
    num_heads,
    num_splits,
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
    SPLIT: tl.constexpr,  # num_splits > 1: partial results to the scratch, else straight to out
    KV_FP8: tl.constexpr,  # the cache is fp8: widen K/V tiles, scale the output by v_scale
    FP8_DOT_F16: tl.constexpr,  # KV_FP8 with a 16-bit query: both dots run in fp16 (see the docstring)
    DECODE: tl.constexpr,  # every query length is <= BLOCK_Q: program i is sequence i's (only) tile
    OFFS_I32: tl.constexpr,  # every element offset of the cache fits int32: 32-bit address math
    BT_AHEAD: tl.constexpr,  # load each tile's block ids one iteration ahead
    SLOT_SUMS: tl.constexpr,  # softmax row sums per key slot, reduced once after the loop
    V_PTX: tl.constexpr,  # FP8_DOT_F16: widen V tiles with inline PTX (_widen_e4m3_ptx)
    PDL: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    if DECODE:
        # No search: its chain of dependent loads is a large part of a short decode program.
        seq = tile
        q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int32)
        q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_begin
        q_tile_start = tl.full((), 0, tl.int32)
    else:
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
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # The step's metadata above was written before the forward's first kernel: it is read while
    # the kernel before this one finishes. Everything below waits for it.
    pdl_wait(PDL)
    if q_tile_start >= q_len:
        return  # spare tile id of this sequence
    ctx_len = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    row_q = q_tile_start + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (row_q < q_len)
    row_pos = ctx_len + row_q

    d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = d < HEAD_DIM
    row_tok = (q_begin + row_q).to(tl.int64)

    # Keys up to the tile's last query position; the rest would be masked anyway.
    kv_end = ctx_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    kv_start = 0
    kv_stop = kv_end
    if SPLIT:
        # This program's part of [0, kv_end): whole BLOCK_N steps, so only the last key step
        # of the tile is partial.
        split = tl.program_id(2)
        # (Plain ceil-divisions, not tl.cdiv: a nested jit call is slow in the interpreter.)
        steps = (kv_end + BLOCK_N - 1) // BLOCK_N
        keys_per_split = (steps + num_splits - 1) // num_splits * BLOCK_N
        kv_start = split * keys_per_split
        kv_stop = tl.minimum(kv_start + keys_per_split, kv_end)
        # Row index into the scratch, in int64: num_splits * T * H * D can pass 2**31.
        p_row = (split.to(tl.int64) * num_tokens + row_tok) * num_heads + row_head
        if kv_start >= kv_stop:
            # Empty part (short context): the neutral result, lse = -inf, and no output.
            tl.store(partial_lse_ptr + p_row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_valid)
            return

    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + row_tok[:, None] * stride_qt + row_head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if FP8_DOT_F16:
        # Clamped: a query past fp16's range saturates instead of becoming inf.
        q = tl.clamp(q.to(tl.float32), -_FP16_MAX, _FP16_MAX).to(tl.float16)

    # A finite floor keeps alpha = exp2(m_old - m_new) at 1, not NaN, while a row has seen
    # only masked keys.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    if SLOT_SUMS:
        l_i = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if OFFS_I32:
        kv_head_off = kv_head * stride_ch
    else:
        kv_head_off = kv_head.to(tl.int64) * stride_ch
    if BT_AHEAD:
        block_next = _block_ids(bt_row, kv_start + offs_n, kv_start + offs_n < kv_stop, BLOCK_SIZE, OFFS_I32)
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < kv_stop
        # Per-key gather through the block table: any block size works with any BLOCK_N.
        if BT_AHEAD:
            # The ids were loaded an iteration earlier: the gather never waits on a block-table
            # load of its own iteration, and the pipeliner can keep two tiles in flight.
            block_id = block_next
            block_next = _block_ids(bt_row, k_pos + BLOCK_N, k_pos + BLOCK_N < kv_stop, BLOCK_SIZE, OFFS_I32)
        else:
            block_id = _block_ids(bt_row, k_pos, k_valid, BLOCK_SIZE, OFFS_I32)
        slot_off = _slot_offsets(block_id, k_pos, stride_cb, stride_cs, kv_head_off, BLOCK_SIZE, OFFS_I32)
        k_t = tl.load(
            k_cache_ptr + slot_off[None, :] + d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0
        )  # [D, BLOCK_N]
        v = tl.load(
            v_cache_ptr + slot_off[:, None] + d[None, :], mask=k_valid[:, None] & d_valid[None, :], other=0.0
        )  # [BLOCK_N, D]
        m_i, l_i, acc = _attend_tile(q, k_t, v, k_pos, kv_stop, row_pos, m_i, l_i, acc, scale_log2,
                                     DOT_PRECISION, KV_FP8, SLOT_SUMS, V_PTX)
    if SLOT_SUMS:
        l_i = tl.sum(l_i, axis=1)

    seen = l_i > 0.0  # False only for rows that saw no key (possible only in a split)
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * v_scale  # linear: the split partials may carry it into the combine
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + p_row, lse, mask=row_valid)
        # Rows without keys store no output: the combine gives them weight 0 and skips them.
        tl.store(partial_out_ptr + p_row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask & seen[:, None])
    else:
        o_off = row_tok[:, None] * stride_ot + row_head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])
def _combine_splits_kernel(
    partial_out_ptr,  # [num_splits, T, H, D] fp32
    partial_lse_ptr,  # [num_splits, T, H] fp32, log2 units; -inf: the split saw no key
    out_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_tokens,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program
    SPLITS_PAD: tl.constexpr,  # >= num_splits; fixed (MAX_SPLITS) so it never recompiles
    PDL: tl.constexpr = False,
):
    tok = tl.program_id(0)
    num_real = tl.load(query_start_loc_ptr + num_seqs)  # step metadata: written before the forward
    pdl_wait(PDL)
    if tok >= num_real:
        return  # padding row: left untouched, as in the unsplit kernel

    s = tl.arange(0, SPLITS_PAD)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, HEAD_DIM_PAD)
    row = (s[:, None].to(tl.int64) * num_tokens + tok) * num_heads + h[None, :]  # [SPLITS_PAD, HEADS]
    lse = tl.load(
        partial_lse_ptr + row, mask=(s < num_splits)[:, None] & (h < num_heads)[None, :], other=float("-inf")
    )
    lse_max = tl.max(lse, axis=0)
    # Every real row sees key 0 in split 0, so lse_max is finite; the guard only keeps an
    # all-empty row at 0 instead of NaN (-inf - -inf).
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weight = tl.exp2(lse - lse_max[None, :])  # exactly 0 for empty splits
    # Skip the outputs of weightless splits: empty splits never wrote theirs.
    part = tl.load(
        partial_out_ptr + row[:, :, None] * HEAD_DIM + d[None, None, :],
        mask=(weight > 0.0)[:, :, None] & (d < HEAD_DIM)[None, None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEADS, HEAD_DIM_PAD]
    total = tl.sum(weight, axis=0)
    acc = tl.sum(part * weight[:, :, None], axis=0) / tl.where(total > 0.0, total, 1.0)[:, None]
    o_off = tok.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=(h < num_heads)[:, None] & (d < HEAD_DIM)[None, :])


def cache_offsets_fit_i32(kv_cache: torch.Tensor) -> bool:
    """Whether every element offset within one half (K or V) of ``kv_cache`` fits int32, so the
    kernel's per-key address arithmetic can stay 32-bit (on sm_90 the 64-bit form was about half
    the bf16 loop's instructions: 1,020 -> 559 per 128-key tile)."""
    half = kv_cache[0]
    last = sum((size - 1) * stride for size, stride in zip(half.shape, half.stride()) if size > 0)
    return last <= 2**31 - 1


def choose_tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int]:
    """Default (BLOCK_M, BLOCK_N): small M for decode-only batches (just the GQA group, >= 16
    for tl.dot), 64 rows once prefill chunks are present."""
    block_m = min(64, max(16, next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    num_sms: int = 132,
    *,
    num_tokens: int | None = None,
    block_q: int = 16,
    max_seq_len: int | None = None,
) -> int:
    """KV splits for one launch: about two programs per SM while the batch alone can't fill
    the GPU, 1 once it can; at most ``MAX_SPLITS``.

    Static facts only (a captured launch is replayed for other contexts and batches):
    ``num_seqs`` sequence slots, ``num_tokens`` query rows (default ``num_seqs *
    max_query_len``), ``block_q`` query tokens per tile. The work is estimated from below:
    at least ``ceil(num_tokens / max_query_len)`` sequences hold the tokens (padded CUDA-graph
    slots hold none) and at least ``ceil(num_tokens / block_q)`` tiles. Guessing the work low
    costs a little (idle programs, the scratch and the combine on short contexts and fresh
    prompts); guessing it high starves long contexts, where one program per KV head walks
    every key alone.
    ``max_seq_len`` (longest context, a hint only valid outside CUDA graphs) keeps every
    split at ``_MIN_KEYS_PER_SPLIT`` keys or more.
    """
    if min(num_seqs, num_kv_heads, num_sms, block_q) < 1:
        raise ValueError(
            f"num_seqs, num_kv_heads, num_sms and block_q must be >= 1, got {num_seqs}, {num_kv_heads}, "
            f"{num_sms}, {block_q}"
        )
    max_query_len = max(1, max_query_len)
    tokens = num_seqs * max_query_len if num_tokens is None else max(1, num_tokens)
    min_seqs = min(num_seqs, -(-tokens // max_query_len))
    min_tiles = max(min_seqs, -(-tokens // block_q))
    splits = (2 * num_sms) // (min_tiles * num_kv_heads)
    if max_seq_len is not None:
        splits = min(splits, -(-max_seq_len // _MIN_KEYS_PER_SPLIT))
    return max(1, min(MAX_SPLITS, splits))


# Stand-in SM count off CUDA. The interpreter runs programs one at a time, so splits only
# cost time there; 16 still splits the small test batches (into 2-8 parts).
_CPU_NUM_SMS = 16


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (132 on an H100/H200); ``_CPU_NUM_SMS`` elsewhere."""
    if device.type != "cuda":
        return _CPU_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def combine_splits(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Merge the split-KV partials into ``out [T, H, D]``: ``partial_out [S, T, H, D]`` (each
    split's normalised output) and ``partial_lse [S, T, H]`` (its log2-sum-exp2 of the scaled
    scores; -inf: no keys, and then its output is never read), both fp32 and contiguous.
    Rows at or past ``query_start_loc[-1]`` are left untouched."""
    num_splits, num_tokens, num_heads, head_dim = partial_out.shape
    if num_splits > MAX_SPLITS:
        raise ValueError(f"at most {MAX_SPLITS} splits, got {num_splits}")
    if num_tokens == 0 or num_heads == 0:
        return out
    head_dim_pad = max(16, next_power_of_2(head_dim))
    # One head per program and one warp on the GPU: many small programs suit a small batch
    # (on an H200, 1 warp ran 2-3x faster than 4 at 512 tokens x 2 splits, and as fast at 1
    # token x 32). The interpreter pays per program, not per element: there, all heads.
    heads = 1 if out.device.type == "cuda" else next_power_of_2(num_heads)
    pdl = pdl_launch(out.device)
    _combine_splits_kernel[(num_tokens, triton.cdiv(num_heads, heads))](
        partial_out,
        partial_lse,
        out,
        query_start_loc,
        query_start_loc.shape[0] - 1,
        num_tokens,
        num_heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEADS=heads,
        SPLITS_PAD=MAX_SPLITS,
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
    )
    return out


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
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_warps: int | None = None,
    num_stages: int | None = None,
    offsets_i32: bool | None = None,
    maxnreg: int | None = None,
    bt_ahead: bool | None = None,
    slot_sums: bool | None = None,
    v_ptx: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query [T, H, D]`` over ``kv_cache [2, blocks, block_size, Hkv, D]``.

    ``block_tables [S, max_blocks]`` (int32), ``seq_lens [S]`` (context length after this
    step) and ``query_start_loc [S+1]`` (cumulative query lengths) describe the batch; the
    cache must already hold this step's keys/values. ``max_query_len`` only picks tile
    sizes, the split count and the decode launch (so it must not be below the longest query;
    a value that fits one query tile, as 1 or a verify step's ``k + 1``, gives one program
    per sequence). Returns ``out [T, H, D]`` (allocated if not given) in query's dtype; rows past
    ``query_start_loc[-1]`` (padding) are left untouched. ``block_m``/``block_n`` override
    the tile sizes (powers of two, ``block_m >= H // Hkv``, both >= 16). ``num_splits``
    (1..MAX_SPLITS) overrides the KV split count; None picks it from the launch's shape
    (``choose_num_splits``), never from tensor values, so it is safe under graph capture.
    ``kv_cache`` is in query's dtype, or fp8 e4m3fn holding ``k / k_scale`` and ``v / v_scale``
    (the scales are ignored for any other cache dtype). ``num_warps`` / ``num_stages`` override
    the launch's (tuning sweeps). ``offsets_i32`` forces the address arithmetic's
    width (None: 32-bit when every element offset of the cache fits, see ``cache_offsets_fit_i32``).
    ``maxnreg`` caps the registers per thread (more programs per SM; tuning sweeps).
    ``bt_ahead`` loads each key tile's block ids one iteration ahead (None: False, except for an
    fp8 one-query decode at the default tiles, which takes it and its stages from
    ``choose_fp8_decode``). ``slot_sums`` keeps the softmax row sums per key slot (summed once at
    the end); ``v_ptx`` widens an fp8 cache's V tiles by inline PTX (fp16 dots, compute capability
    8.9+; elsewhere, and in the interpreter, which runs no inline PTX, the launch is the same
    without it). None: both from the same preset.
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
    kv_fp8 = kv_cache.dtype == FP8_KV_DTYPE
    if kv_cache.dtype != query.dtype and not kv_fp8:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} is neither query's ({query.dtype}) nor {FP8_KV_DTYPE}")
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
    if block_m < group or block_m & (block_m - 1) or block_m < 16 or (block_n is not None and (
            block_n & (block_n - 1) or block_n < 16)):
        raise ValueError(f"bad tiles block_m={block_m}, block_n={block_n} for GQA group {group}")
    block_q = block_m // group
    one_query_decode = max_query_len <= 1 and head_dim <= 128
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_query_len, _num_sms(query.device), num_tokens=num_tokens, block_q=block_q
        )
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    # Every query fits one tile: one program per sequence (a plain or a multi-query decode).
    decode = max(1, max_query_len) <= block_q
    if one_query_decode and kv_fp8 and bt_ahead is None and block_n is None:
        # The default tiles only: an explicit block_n keeps its own stages (as its registers).
        preset = FP8_DECODE_PRESETS[choose_fp8_decode(num_seqs, num_kv_heads, num_splits, _num_sms(query.device))]
        bt_ahead = bool(preset.get("bt_ahead"))
        num_stages = num_stages or preset.get("num_stages")  # type: ignore[assignment]
        slot_sums = preset.get("slot_sums", False) if slot_sums is None else slot_sums  # type: ignore[assignment]
        v_ptx = preset.get("v_ptx", False) if v_ptx is None else v_ptx  # type: ignore[assignment]
    bt_ahead = bool(bt_ahead)
    slot_sums = bool(slot_sums)
    fp8_dot_f16 = kv_fp8 and query.dtype != torch.float32
    # _widen_e4m3_ptx's conversion: compute capability 8.9+, compiled (the interpreter runs no PTX).
    v_ptx = bool(v_ptx) and fp8_dot_f16 and (compiled_capability(query.device) or (0, 0)) >= (8, 9)
    if one_query_decode and (num_splits == 1 or kv_fp8):
        # A large decode batch (or any over an fp8 cache): 64-key tiles in two stages, capped at
        # 4 programs per SM (see _DECODE_MAXNREG); an explicit block_n keeps its own registers.
        if block_n is None:
            block_n = 64
            maxnreg = maxnreg or (_DECODE_MAXNREG if query.device.type == "cuda" else None)
        num_stages = num_stages or 2
    block_n = block_n or default_n

    if offsets_i32 is None:
        offsets_i32 = cache_offsets_fit_i32(kv_cache)
    elif offsets_i32 and not cache_offsets_fit_i32(kv_cache):
        raise ValueError("offsets_i32=True, but the cache's element offsets do not fit int32")

    split = num_splits > 1
    if split:
        # torch.empty: every slot the combine reads is written first. Under graph capture this
        # comes from the graph's pool.
        partial_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the unsplit kernel
    grid = (num_seqs if decode else num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    pdl = pdl_launch(query.device)
    _paged_attention_kernel[grid](
        query,
        kv_cache[0],
        kv_cache[1],
        out,
        partial_out,
        partial_lse,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * (k_scale if kv_fp8 else 1.0) * _LOG2E,
        v_scale,
        num_seqs,
        num_tokens,
        num_heads,
        num_splits,
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
        SPLIT=split,
        KV_FP8=kv_fp8,
        FP8_DOT_F16=fp8_dot_f16,
        DECODE=decode,
        OFFS_I32=offsets_i32,
        BT_AHEAD=bt_ahead,
        SLOT_SUMS=slot_sums,
        V_PTX=v_ptx,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=num_warps or (4 if block_m * max(16, next_power_of_2(head_dim)) <= 64 * 128 else 8),
        **({"num_stages": num_stages} if num_stages else {}),
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    if split:
        combine_splits(partial_out, partial_lse, query_start_loc, out)
    return out


__all__ = ["FP8_DECODE_PRESETS", "MAX_SPLITS", "cache_offsets_fit_i32", "choose_fp8_decode", "choose_num_splits", "choose_tiles", "combine_splits", "paged_attention"]
