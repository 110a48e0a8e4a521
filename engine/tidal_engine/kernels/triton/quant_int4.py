"""INT4 (AWQ / GPTQ) kernels over the layout quantization/int4.py repacks both formats into:
``qweight`` int32 ``[N, K/8]`` (input ``8j + i`` of a row in nibble ``i`` of word ``j``),
``scales`` and ``zeros`` ``[N, K/g]`` in the run dtype, ``w[n, k] = (q - zeros[n, k/g]) * scales[n, k/g]``.

- ``int4_gemv``: a few rows (decode), never building the dequantized tile: a word's 8 inputs
  share one group, so ``sum_i (q_i - z) s x_i = s (sum_i q_i x_i - z sum_i x_i)``. Four kernels,
  all candidates of the start-up choice (kernels/gemv_choice.py):
  - by groups (``GroupGemvConfig``): a ``[BLOCK_N, groups, words of a group]`` tile of words a
    step, loaded in 16-byte vectors; a thread holds several rows of the same few words, so one
    load of the activations and one of each row's scale and zero serve many weights, and each
    weight costs a mask-or, a subtraction and a multiply-add;
  - by groups in packed halves (``PackedGemvConfig``, CUDA only: inline PTX): the by-groups
    tile, each word's 8 products taken two at a time in fp16x2 (about 2 instructions a weight
    against 4.3), see ``_int4_packed_gemv_kernel`` for the arithmetic and its accuracy; the
    fastest at one row on the H200;
  - by words (``GemvConfig``): ``BLOCK_K``-wide runs of words, scale and zero loaded per word;
  - on tensor cores (``TcGemvConfig``): ``W @ x^T`` with the weights as the dot's first operand
    and the few rows padded to 16, a group step's nibbles turned into the integers ``q - z``
    (one multiply-add each) and its sums scaled once.
  The tensor-core kernel may split K over ``split_k`` programs, which add fp32 partial sums
  into a workspace the last of them reads, zeroes and writes out (no memset between calls, so
  it works inside CUDA graphs). The packed-halves kernel may too: each of a tile's programs
  stores its fp32 sums in its own slice, and the last adds the slices in a fixed order (the
  same result whichever finished first), writes out (SiLU-and-mul folded included) and resets
  its tile's counter.
  Input rows are the fastest grid axis of the first three, so the programs of a few rows share
  the words in L2. The by-groups kernels (both) take ``silu_and_mul`` for a gated MLP's gate|up
  weight: a program takes gate row i next to up row I + i (gemv.py's ``program_rows``) and
  writes ``silu(gate) * up`` (``store_rows``), so a decode step runs no activation kernel.
- ``int4_gemm``: more rows (prefill, decode batches). A ``[BLOCK_N, BLOCK_K/8]`` tile of words
  is loaded once, coalesced; each of its 8 nibbles is dequantized to the activations' dtype in
  registers, the 8 planes are interleaved back into input order (``tl.join``, reshape) and fed
  to ``tl.dot``. ``BLOCK_K`` divides the group size, so a step needs one scale and zero per
  output column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import pdl_launch, pdl_wait, stream_capturing
from tidal_engine.kernels.triton.gemv import (
    MAX_GRID_Y,
    GemvConfig,
    check_gated,
    check_grid_rows,
    program_rows,
    store_rows,
    tile_folds_silu_and_mul,
)

PACK = 8
FLOAT_2_23_BITS = 0x4B000000  # float32 2^23: a small integer or-ed into its mantissa reads as 2^23 + it


@dataclass(frozen=True)
class GroupGemvConfig(GemvConfig):
    """A tile of the by-groups GEMV: ``block_n`` rows × ``block_k`` inputs (whole groups) a step.
    Its ``block_k`` values (1024 and up) are not those of the by-words candidates (up to 512), so a
    choice stored as (block_n, block_k, num_warps) names one kernel."""


@dataclass(frozen=True)
class PackedGemvConfig(GemvConfig):
    """A tile of the packed-halves by-groups GEMV: ``block_n`` rows × ``block_k`` inputs (whole
    groups) a step, as ``GroupGemvConfig``; ``num_stages`` 2 loads the next step while this one
    computes (registers), 1 does not; ``split_k`` programs share a tile's K, each over a
    contiguous run of whole steps, the last of them adding their fp32 sums in a fixed order
    (``_int4_packed_gemv_kernel``). ``kernel`` and ``split_k`` are stored with a choice
    (compile_cache.encode_choice), so the kernels' tiles never read as each other."""

    num_stages: int = 1
    split_k: int = 1
    kernel: ClassVar[str] = "f16x2"


@dataclass(frozen=True)
class PairedPackedGemvConfig(PackedGemvConfig):
    """A tile of the packed-halves GEMV that sums two words' products in each fp16 lane before
    widening (``_word_pair_dot_f16x2``: about 1.5 instructions a word fewer; activations scaled
    one power of two lower, and 9 fp16 roundings a sum instead of 5). Stored as its own kernel.
    Not a start-up candidate: on the H200 it was 2-9% slower than its one-word twin at one row
    (benchmarks/results/h200-2026-12-02-int4b); int4_micro.py times it."""

    kernel: ClassVar[str] = "f16x2w2"


@dataclass(frozen=True)
class TcGemvConfig(GemvConfig):
    """A tile of the tensor-core GEMV: ``block_n`` weight rows × ``block_k`` inputs (within one
    group) a step, the K loop cut into ``split_k`` programs (partial sums added in fp32), the
    word loads pipelined ``num_stages`` deep. Its ``block_k`` values (64, 128) are neither the
    by-groups (1024+) nor the by-words (512) ones."""

    split_k: int = 1
    num_stages: int = 3


# The candidates timed at start-up (kernels/gemv_choice.py); block_k counts weights (8 a word).
INT4_GEMV_CONFIGS: tuple[GemvConfig, ...] = (
    # By groups in packed halves (CUDA only): on the H200 (benchmarks/results/h200-2026-12-02-int4)
    # the prefetching 16 x 1024 tile wins one row on every 8B shape (53.3 us a layer against the
    # fp32 by-groups kernel's 77.4) and 4 rows on two; 32 x 1024 wins 4 rows of 6144 x 4096.
    PackedGemvConfig(16, 1024, 4, 2),
    PackedGemvConfig(16, 1024, 4),
    PackedGemvConfig(32, 1024, 4),
    # Swept again under programmatic dependent launch (h200-2026-12-02-tenth, call 6): half-width
    # steps on two warps took 24576 x 4096 in 20.7 us (folded 21.8) against 23.3 (23.7), and
    # double-width steps 4096 x 4096 in 5.6 against 6.1.
    PackedGemvConfig(16, 512, 2, 2),
    PackedGemvConfig(16, 2048, 4, 2),
    # Split K in two (each program half of the steps, the last of a tile adding the two partial
    # sums): wins one row of 4096 x 12288 (down; 13.5 us against 14.1) and nothing else
    # (h200-2026-12-02-int4c: 7.3 against 6.5 us on 4096 x 4096, 11.6 against 7.7 on 6144 x 4096).
    # Not split 4, nor 8-row tiles split or not: slower on every 8B shape.
    PackedGemvConfig(16, 1024, 4, 2, split_k=2),
    # Not the two-words-a-sum twins (PairedPackedGemvConfig): the prefetching tile 2-9% slower at one row on every
    # 8B shape despite fewer instructions, never chosen (h200-2026-12-02-int4b).
    # By groups, fp32 word math: where the packed kernel cannot run (before sm_80, groups of 16).
    GroupGemvConfig(16, 2048, 4),
    GroupGemvConfig(16, 1024, 4),
    # By words: any group size.
    GemvConfig(8, 512, 4),
    # Tensor cores: 2-4 rows cost what one row does (24576 x 4096 at 4 rows: 47 us against the
    # GEMM's 53 and the packed kernel's 76.5; 1.3-2.5x slower than by groups at one row).
    TcGemvConfig(64, 128, 4, 1),
    TcGemvConfig(64, 64, 4, 4),
)


# A word's nibble i is q * 16^(i%4) as a float after masking it in place (the upper four
# nibbles after one shift by 16) and the 2^23 trick: a mask-or and an add per weight, then the
# multiply-add with x_i / 16^(i%4), exact (a power of two).
# stride_qn stays unspecialised: with the rows' alignment unknown the words load one per
# thread, each thread then holds several rows of one word column, and the 8 activation
# loads of a word serve all of them (with 4-word vector loads each thread would reload x
# for 4 columns: 4× the L1 traffic).
@triton.jit(do_not_specialize=["stride_qn"])
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
):
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_sn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    words_per_row = K // 8
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for w0 in range(0, words_per_row, BLOCK_W):
        j = w0 + tl.arange(0, BLOCK_W)
        group = (j * 8 // GROUP)[None, :]
        if EVEN:  # no masks: N and K/8 are multiples of the tile
            words = tl.load(q_rows + j[None, :])
            s = tl.load(s_rows + group).to(tl.float32)
            z = tl.load(z_rows + group).to(tl.float32)
        else:
            j_ok = j < words_per_row
            ok = row_ok[:, None] & j_ok[None, :]
            words = tl.load(q_rows + j[None, :], mask=ok, other=0)
            s = tl.load(s_rows + group, mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_rows + group, mask=ok, other=0.0).to(tl.float32)
        high = words >> 16
        dot = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        x_sum = tl.zeros([BLOCK_W], tl.float32)
        for i in tl.static_range(8):
            if EVEN:
                x_i = tl.load(x_row + j * 8 + i).to(tl.float32)
            else:
                x_i = tl.load(x_row + j * 8 + i, mask=j < words_per_row, other=0.0).to(tl.float32)
            x_sum += x_i
            # Nibble i in place (times 16^(i%4)) in the mantissa; x_i carries the 16^-(i%4).
            # ``magic`` (2^23's bits) is an argument, not a constant, so the mask and the or
            # fuse into one three-input logic operation.
            half = words if i < 4 else high
            place = (half & (0xF << (4 * (i % 4)))) | magic
            weight = place.to(tl.float32, bitcast=True) - 8388608.0
            dot += weight * (x_i * (1.0 / (1 << (4 * (i % 4)))))[None, :]
        acc += s * (dot - z * x_sum[None, :])
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


# The by-groups GEMV. Per step a tile of ``GROUPS`` whole groups of ``BLOCK_N`` rows: words
# ``[BLOCK_N, GROUPS, GROUP/8]`` (16-byte loads along a group's words), scales and zeros
# ``[BLOCK_N, GROUPS]``, and per nibble the activations of those words ``[GROUPS, GROUP/8]``,
# shared by every row a thread holds. The weight math is the by-words kernel's.
@triton.jit
def _int4_group_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
):
    GW: tl.constexpr = GROUP // 8  # words of a group
    m = tl.program_id(0)
    rows, row_ok = program_rows(tl.program_id(1), N, BLOCK_N, SILU_AND_MUL)
    g = tl.arange(0, GROUPS)
    t = tl.arange(0, GW)
    rows64 = rows.to(tl.int64)
    q_tile = q_ptr + rows64[:, None, None] * stride_qn + (g[None, :, None] * GW + t[None, None, :])
    s_tile = s_ptr + rows64[:, None] * stride_sn + g[None, :]
    z_tile = z_ptr + rows64[:, None] * stride_sn + g[None, :]
    x_tile = x_ptr + m.to(tl.int64) * stride_xm + g[:, None] * GROUP + t[None, :] * 8
    n_groups = K // GROUP
    acc = tl.zeros([BLOCK_N, GROUPS], tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        if EVEN:  # no masks: N and the groups are multiples of the tile
            words = tl.load(q_tile + g0 * GW)
            s = tl.load(s_tile + g0).to(tl.float32)
            z = tl.load(z_tile + g0).to(tl.float32)
        else:
            g_ok = (g0 + g) < n_groups
            ok = row_ok[:, None] & g_ok[None, :]
            words = tl.load(q_tile + g0 * GW, mask=ok[:, :, None], other=0)
            s = tl.load(s_tile + g0, mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_tile + g0, mask=ok, other=0.0).to(tl.float32)
        high = words >> 16
        dot = tl.zeros([BLOCK_N, GROUPS, GW], tl.float32)
        x_sum = tl.zeros([GROUPS, GW], tl.float32)
        for i in tl.static_range(8):
            if EVEN:
                x_i = tl.load(x_tile + g0 * GROUP + i).to(tl.float32)
            else:
                x_i = tl.load(x_tile + g0 * GROUP + i, mask=g_ok[:, None], other=0.0).to(tl.float32)
            x_sum += x_i
            half = words if i < 4 else high
            place = (half & (0xF << (4 * (i % 4)))) | magic
            weight = place.to(tl.float32, bitcast=True) - 8388608.0
            dot += weight * (x_i * (1.0 / (1 << (4 * (i % 4)))))[None, :, :]
        acc += s * (tl.sum(dot, axis=2) - z * tl.sum(x_sum, axis=1)[None, :])
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_rows(out_ptr + m.to(tl.int64) * stride_om, y, rows, row_ok, tl.program_id(1), N, BLOCK_N, SILU_AND_MUL)


# ---- by groups in packed halves (fp16x2), CUDA only ----------------------------------------
# fp16 bits used below: 0x6400 is 1024, where the mantissa's step is 1, so ``0x6400 | q`` reads
# as 1024 + q and ``0x6400 | q << 4`` as 1024 + 16 q; 0x2C00 is 1/16; 0xD400 is -64, where the
# step is 1/16, so 0xD400 + 16 z is -(64 + z).
# A group's activations are scaled by 2^(X_TOP - E), E the exponent of their largest |x|, so that
# they stay below 2^(X_TOP + 1) (the overflow bound in _int4_packed_gemv_kernel's comment).
X_TOP = tl.constexpr(7)
EXPONENT_FLOOR = tl.constexpr(27)  # biased: E >= -100, so 2^(X_TOP - E) and 2^(E - X_TOP) are normal fp32


@triton.jit
def _pack_f16x2(lo, hi):
    """Two fp32 tensors → int32 tensor of fp16 pairs (``lo`` in the low half), each rounded to nearest."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _packed_step_weights(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, g0, g, row_ok, n_groups, GW: tl.constexpr,
                         EVEN: tl.constexpr, live=None):
    """A step's words, scales and zeros (fp32) of groups ``g0 + g`` (``q_offs``, ``sz_offs``: int32
    offsets from the tensors' starts). ``live``: a scalar; when false nothing is read (the values
    are then undefined)."""
    if EVEN:  # no masks: N and the groups are multiples of the tile
        words = tl.load(q_ptr + (q_offs + g0 * GW), mask=live)
        s = tl.load(s_ptr + (sz_offs + g0), mask=live).to(tl.float32)
        z = tl.load(z_ptr + (sz_offs + g0), mask=live).to(tl.float32)
    else:
        ok = row_ok[:, None] & ((g0 + g) < n_groups)[None, :]
        if live is not None:
            ok = ok & live
        words = tl.load(q_ptr + (q_offs + g0 * GW), mask=ok[:, :, None], other=0)
        s = tl.load(s_ptr + (sz_offs + g0), mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + (sz_offs + g0), mask=ok, other=0.0).to(tl.float32)
    return words, s, z


@triton.jit
def _packed_step_x(x_tile, g0, g, n_groups, GROUP: tl.constexpr, EVEN: tl.constexpr, live=None):
    """A step's activations (fp32) of groups ``g0 + g`` (nothing read where ``live`` is false)."""
    if EVEN:
        return tl.load(x_tile + g0 * GROUP, mask=live).to(tl.float32)
    ok = (g0 + g) < n_groups
    if live is not None:
        ok = ok & live
    return tl.load(x_tile + g0 * GROUP, mask=ok[:, None, None], other=0.0).to(tl.float32)


@triton.jit
def _packed_step_loads(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, x_tile, g0, g, row_ok, n_groups, GW: tl.constexpr,
                       GROUP: tl.constexpr, EVEN: tl.constexpr):
    """A step's words, scales and zeros (``_packed_step_weights``) and activations."""
    words, s, z = _packed_step_weights(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, g0, g, row_ok, n_groups, GW, EVEN)
    return words, s, z, _packed_step_x(x_tile, g0, g, n_groups, GROUP, EVEN)


@triton.jit
def _word_dot_f16x2(words, x04, x15, x26, x37, z_low, z_high):
    """Per int32 word of 8 nibbles (input i in nibble i), in fp32: ``sum_i (q_i - z) x'_i``.

    ``x04`` ... ``x37``: the word's activations as fp16 pairs (x'_0 low, x'_4 high) ...;
    ``z_low``: fp16 pairs 1024 + z; ``z_high``: fp16 pairs -(64 + z). Per word: a shift, four
    mask-ors giving the pairs (1024 + q_0, 1024 + q_4), (1024 + 16 q_1, 1024 + 16 q_5) and the same
    for nibbles 2, 6 and 3, 7 after the shift; ``q - z`` exactly, by a subtraction of 1024 + z or
    a multiply-add by 1/16 minus 64 + z; four products summed in each fp16 lane (one multiply,
    three multiply-adds); the two lanes added in fp16 and widened to fp32."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 w8, p0, p1, p2, p3, acc, sixteenth;
        .reg .f16 lo, hi, sum;
        mov.b32 sixteenth, 0x2C002C00;
        shr.u32 w8, $1, 8;
        lop3.b32 p0, $1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p1, $1, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 p2, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p3, w8, 0x00F000F0, 0x64006400, 0xEA;
        sub.rn.f16x2 p0, p0, $6;
        fma.rn.f16x2 p1, p1, sixteenth, $7;
        sub.rn.f16x2 p2, p2, $6;
        fma.rn.f16x2 p3, p3, sixteenth, $7;
        mul.rn.f16x2 acc, p0, $2;
        fma.rn.f16x2 acc, p1, $3, acc;
        fma.rn.f16x2 acc, p2, $4, acc;
        fma.rn.f16x2 acc, p3, $5, acc;
        mov.b32 {lo, hi}, acc;
        add.rn.f16 sum, lo, hi;
        cvt.f32.f16 $0, sum;
        }
        """,
        "=r,r,r,r,r,r,r,r", [words, x04, x15, x26, x37, z_low, z_high], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _word_pair_dot_f16x2(words_a, words_b, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, z_low, z_high):
    """``_word_dot_f16x2`` of two words of one group (same zero), their eight products a lane
    summed in fp16 (one multiply, seven multiply-adds) before the lanes are added and widened:
    per word pair one lane sum and one widening instead of two."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 w8, p0, p1, p2, p3, acc, sixteenth;
        .reg .f16 lo, hi, sum;
        mov.b32 sixteenth, 0x2C002C00;
        shr.u32 w8, $1, 8;
        lop3.b32 p0, $1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p1, $1, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 p2, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p3, w8, 0x00F000F0, 0x64006400, 0xEA;
        sub.rn.f16x2 p0, p0, $11;
        fma.rn.f16x2 p1, p1, sixteenth, $12;
        sub.rn.f16x2 p2, p2, $11;
        fma.rn.f16x2 p3, p3, sixteenth, $12;
        mul.rn.f16x2 acc, p0, $3;
        fma.rn.f16x2 acc, p1, $4, acc;
        fma.rn.f16x2 acc, p2, $5, acc;
        fma.rn.f16x2 acc, p3, $6, acc;
        shr.u32 w8, $2, 8;
        lop3.b32 p0, $2, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p1, $2, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 p2, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 p3, w8, 0x00F000F0, 0x64006400, 0xEA;
        sub.rn.f16x2 p0, p0, $11;
        fma.rn.f16x2 p1, p1, sixteenth, $12;
        sub.rn.f16x2 p2, p2, $11;
        fma.rn.f16x2 p3, p3, sixteenth, $12;
        fma.rn.f16x2 acc, p0, $7, acc;
        fma.rn.f16x2 acc, p1, $8, acc;
        fma.rn.f16x2 acc, p2, $9, acc;
        fma.rn.f16x2 acc, p3, $10, acc;
        mov.b32 {lo, hi}, acc;
        add.rn.f16 sum, lo, hi;
        cvt.f32.f16 $0, sum;
        }
        """,
        "=r,r,r,r,r,r,r,r,r,r,r,r,r", [words_a, words_b, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, z_low, z_high],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _word_pairs(t, DIM0: tl.constexpr, DIM1: tl.constexpr, GW: tl.constexpr):
    """``t [DIM0, DIM1, GW]`` → its even and odd words, each ``[DIM0, DIM1, GW // 2]``."""
    return tl.split(tl.reshape(t, [DIM0, DIM1, GW // 2, 2]))


@triton.jit
def _packed_step_sums(words, s, z, x, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GW: tl.constexpr,
                      XT: tl.constexpr, PAIRED: tl.constexpr):
    """One step's contribution to the accumulator ``[BLOCK_N, GROUPS, GW // 4]``: each group's
    word sums (activations scaled by a power of two, paired in fp16) times its scale and factor."""
    # The biased exponent of each group's largest |x| (0 for an all-zero group, floored).
    biased = (tl.max(tl.max(tl.abs(x), axis=2), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.maximum(biased, EXPONENT_FLOOR)
    down = ((254 + XT - biased) << 23).to(tl.float32, bitcast=True)  # 2^(XT - E)
    up = ((biased - XT) << 23).to(tl.float32, bitcast=True)  # 2^(E - XT)
    # Input 8j + 4a + 2b + c of the step at [.., j, a, b, c]: split off c, b, then a.
    x_pairs = tl.reshape(x * down[:, None, None], [GROUPS, GW, 2, 2, 2])
    even, odd = tl.split(x_pairs)
    x0_4, x2_6 = tl.split(even)
    x1_5, x3_7 = tl.split(odd)
    x0, x4 = tl.split(x0_4)
    x2, x6 = tl.split(x2_6)
    x1, x5 = tl.split(x1_5)
    x3, x7 = tl.split(x3_7)
    zi = z.to(tl.int32)  # 0..16, exact
    z_low = ((0x6400 + zi) * 0x10001)[:, :, None]  # 1024 + z, twice
    z_high = ((0xD400 + zi * 16) * 0x10001)[:, :, None]  # -(64 + z), twice
    x04, x15 = _pack_f16x2(x0, x4)[None, :, :], _pack_f16x2(x1, x5)[None, :, :]
    x26, x37 = _pack_f16x2(x2, x6)[None, :, :], _pack_f16x2(x3, x7)[None, :, :]
    if PAIRED:  # words 2j and 2j + 1 in one fp16 sum
        wa, wb = _word_pairs(words, BLOCK_N, GROUPS, GW)
        xa04, xb04 = _word_pairs(x04, 1, GROUPS, GW)
        xa15, xb15 = _word_pairs(x15, 1, GROUPS, GW)
        xa26, xb26 = _word_pairs(x26, 1, GROUPS, GW)
        xa37, xb37 = _word_pairs(x37, 1, GROUPS, GW)
        dots = _word_pair_dot_f16x2(wa, wb, xa04, xa15, xa26, xa37, xb04, xb15, xb26, xb37, z_low, z_high)
        dots = tl.sum(tl.reshape(dots, [BLOCK_N, GROUPS, GW // 4, 2]), axis=3)
    else:
        dots = _word_dot_f16x2(words, x04, x15, x26, x37, z_low, z_high)
        dots = tl.sum(tl.reshape(dots, [BLOCK_N, GROUPS, GW // 4, 4]), axis=3)
    return dots * (s * up[None, :])[:, :, None]


# The by-groups GEMV with the word math in fp16 pairs. The tile and loads are the by-groups
# kernel's; per step, each group's activations (fp32) are scaled by 2^(X_TOP - E), E the
# exponent of the group's largest |x| (a power of two: exact), rounded to fp16 and paired as a
# word needs them; each word gives sum_i (q_i - z) x'_i (_word_dot_f16x2), and its group's
# sum is multiplied by scale * 2^(E - X_TOP) in fp32.
#
# Overflow: |x'| < 2^(X_TOP + 1) = 256 and |q - z| <= 16 (GPTQ v1 can store a zero of 16), so a
# lane's four products stay below 4 * 16 * 256 = 16384 and the word's sum below 32768 < 65504.
# Accuracy: q - z is exact; x' equals x * 2^(X_TOP - E) exactly unless it falls below fp16's
# normal range, |x| < 2^(E - 21), where it is off by at most 2^-25 * 2^(E - X_TOP) < max|x| 2^-32
# (absolute); each product is exact before its one rounding, and a word's sum takes five fp16
# roundings (one product, three multiply-adds, the lane sum), each within 2^-11 of a partial sum
# of that word's at most 8 terms, so at most about 5 * 2^-11 = 2^-8.7 of the word's sum of
# |(q - z) x| (typically far less: the errors are independent); everything after is fp32. The
# torch reference rounds each weight (q - z) * s to 16 bits (bf16: within 2^-9 of every term), so
# the two are of one order. With PAIRED (two words a lane sum, _word_pair_dot_f16x2) the
# activations are scaled one power of two lower, |x'| < 2^X_TOP = 128, so a lane's eight products
# stay below 8 * 16 * 128 = 16384 and the pair's sum below 32768; the pair's sum takes nine fp16
# roundings (one product, seven multiply-adds, the lane sum): at most about 9 * 2^-11 = 2^-7.8
# of the pair's sum of |(q - z) x| (x' exact down to max|x| 2^-31); the CPU tests check an emulation of exactly this arithmetic against
# that bound with activations up to 3e4, and the GPU tests check the kernel against the emulation.
@triton.jit
def _int4_packed_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    WS_N,
    ws_part_stride,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
    PAIRED: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    GW: tl.constexpr = GROUP // 8  # words of a group
    XT: tl.constexpr = X_TOP - PAIRED  # |x'| < 2^(XT + 1)
    m = tl.program_id(0)
    tile = tl.program_id(1) // SPLIT  # a tile's SPLIT programs are neighbours on the grid
    part = tl.program_id(1) % SPLIT
    rows, row_ok = program_rows(tile, N, BLOCK_N, SILU_AND_MUL)
    g = tl.arange(0, GROUPS)
    t = tl.arange(0, GW)
    # int32 offsets from the tensors' starts (the caller checks they fit): one add a 16-byte load.
    q_offs = rows[:, None, None] * stride_qn + (g[None, :, None] * GW + t[None, None, :])
    sz_offs = rows[:, None] * stride_sn + g[None, :]
    # A step's activations [groups, words, 8], each word's 8 inputs contiguous (16-byte loads).
    x_tile = (x_ptr + m.to(tl.int64) * stride_xm + g[:, None, None] * GROUP + t[None, :, None] * 8
              + tl.arange(0, 8)[None, None, :])
    n_groups = K // GROUP
    # This program's groups: all of them, or with SPLIT > 1 its run of whole steps (the caller
    # checks SPLIT * GROUPS divides the groups).
    g_start = part * (n_groups // SPLIT)
    g_end = g_start + n_groups // SPLIT
    # Word sums are added four at a time in registers (the 4 words a 16-byte load holds).
    acc = tl.zeros([BLOCK_N, GROUPS, GW // 4], tl.float32)
    g_loop = g_start
    if PREFETCH:  # the first step's weights load while the kernel before this one finishes
        words, s, z = _packed_step_weights(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, g_start, g, row_ok, n_groups, GW,
                                           EVEN)
        if PDL:  # and the second's: two steps in flight before the wait, the first step peeled off
            g_loop = g_start + GROUPS
            words1, s1, z1 = _packed_step_weights(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, g_loop, g, row_ok, n_groups,
                                                  GW, EVEN, g_loop < g_end)
            pdl_wait(PDL)
            x = _packed_step_x(x_tile, g_start, g, n_groups, GROUP, EVEN)
            x1 = _packed_step_x(x_tile, g_loop, g, n_groups, GROUP, EVEN, g_loop < g_end)
            acc += _packed_step_sums(words, s, z, x, BLOCK_N, GROUPS, GW, XT, PAIRED)
            words, s, z, x = words1, s1, z1, x1
        else:
            x = _packed_step_x(x_tile, g_start, g, n_groups, GROUP, EVEN)
    else:
        pdl_wait(PDL)
    for g0 in range(g_loop, g_end, GROUPS):
        if PREFETCH:  # the next step's loads in flight while this one computes (the last wraps to the first)
            g_next = g0 + GROUPS
            g_next = tl.where(g_next < g_end, g_next, g_start)
            next_loads = _packed_step_loads(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, x_tile, g_next, g, row_ok,
                                            n_groups, GW, GROUP, EVEN)
        else:
            words, s, z, x = _packed_step_loads(q_ptr, s_ptr, z_ptr, q_offs, sz_offs, x_tile, g0, g, row_ok,
                                                n_groups, GW, GROUP, EVEN)
        acc += _packed_step_sums(words, s, z, x, BLOCK_N, GROUPS, GW, XT, PAIRED)
        if PREFETCH:
            words, s, z, x = next_loads
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT > 1:
        # Each program stores its fp32 sums in its own slice of ws ([SPLIT, rows, WS_N], a slice
        # ``ws_part_stride`` long, WS_N the weight's rows: with SILU_AND_MUL 2N);
        # the last of a tile's programs (cnt_ptr counts them) reads all SPLIT slices through L2
        # and adds them in slice order, so the result does not depend on which finished first,
        # and resets its counter for the next call (and the next CUDA-graph replay).
        ws_rows = ws_ptr + (m * WS_N + rows).to(tl.int64)
        tl.store(ws_rows + part.to(tl.int64) * ws_part_stride, y, mask=row_ok)
        tl.debug_barrier()  # every thread's sums are stored before the count says so
        counter = cnt_ptr + m * (tl.num_programs(1) // SPLIT) + tile
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == SPLIT - 1:
            y = tl.load(ws_rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            for i in tl.static_range(1, SPLIT):
                y += tl.load(ws_rows + i * ws_part_stride, mask=row_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            store_rows(out_ptr + m.to(tl.int64) * stride_om, y, rows, row_ok, tile, N, BLOCK_N, SILU_AND_MUL)
            tl.store(counter, 0)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        store_rows(out_ptr + m.to(tl.int64) * stride_om, y, rows, row_ok, tile, N, BLOCK_N, SILU_AND_MUL)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"int4 kernels take x of shape [M, K]; got {tuple(x.shape)}")
    n, words = qweight.shape
    k = words * PACK
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, qweight holds {k}")
    if k % group_size or group_size % PACK:
        raise ValueError(f"group size {group_size} must be a multiple of {PACK} that divides {k}")
    if tuple(scales.shape) != (n, k // group_size) or scales.shape != zeros.shape or scales.stride() != zeros.stride():
        raise ValueError(f"scales and zeros must both be [{n}, {k // group_size}] with the same strides")
    if qweight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("qweight's and scales' last dims must be contiguous")


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_packed_split(split: int, m: int, n_groups: int, groups_a_step: int) -> None:
    """The packed-halves GEMV splits K into ``split`` runs of whole steps, for up to
    ``TC_GEMV_ROWS`` input rows (its workspace's)."""
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"split_k must be a positive integer, not {split!r}")
    if split == 1:
        return
    if m > TC_GEMV_ROWS:
        raise ValueError(f"the split-K packed INT4 GEMV takes up to {TC_GEMV_ROWS} rows, not {m}")
    if n_groups % (groups_a_step * split):
        raise ValueError(f"{n_groups} groups do not split into {split} runs of whole steps of {groups_a_step} groups")


def int4_tile_folds_silu_and_mul(config: GemvConfig | None, n: int) -> bool:
    """Whether ``int4_gemv(..., silu_and_mul=True)`` runs with tile ``config`` on a gate|up weight
    of ``n`` rows: the by-groups kernels (packed halves and fp32) with whole gate/up pairs a tile."""
    return isinstance(config, (PackedGemvConfig, GroupGemvConfig)) and tile_folds_silu_and_mul(config, n)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, config: GemvConfig, silu_and_mul: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias)`` → ``[M, N]`` in x's dtype, for small M; a
    ``GroupGemvConfig`` runs the by-groups kernel, a ``PackedGemvConfig`` its packed-halves twin
    (CUDA only), a ``TcGemvConfig`` the tensor-core one, a plain ``GemvConfig`` the by-words one.
    ``silu_and_mul`` (the by-groups kernels, ``int4_tile_folds_silu_and_mul``): the weight is a
    gated MLP's gate|up (N = 2I) and the result ``silu(gate) * up``, ``[M, I]``: a program takes
    gate row i next to up row I + i (gemv.py's ``program_rows``), each row's sum computed as
    without it, rounded as the plain store rounds it, then activated as the activation kernel does."""
    _check(x, qweight, scales, zeros, group_size)
    n, words = qweight.shape
    if config.block_k % PACK:
        raise ValueError(f"block_k {config.block_k} is not a whole number of words")
    if silu_and_mul and not isinstance(config, (PackedGemvConfig, GroupGemvConfig)):
        raise ValueError(f"silu_and_mul runs in the by-groups INT4 GEMVs only, not {config}")
    if isinstance(config, TcGemvConfig):
        return _int4_tc_gemv(x if x.stride(1) == 1 else x.contiguous(), qweight, scales, zeros, group_size, bias,
                             config)
    packed = isinstance(config, PackedGemvConfig)
    by_groups = packed or isinstance(config, GroupGemvConfig)
    if by_groups and (config.block_k % group_size or not _is_power_of_two(group_size)
                      or not _is_power_of_two(config.block_k // group_size)):
        raise ValueError(f"block_k {config.block_k} is not a power-of-two number of groups of {group_size}")
    split = config.split_k if packed else 1
    if packed:
        _check_packed_split(split, x.shape[0], words * PACK // group_size, config.block_k // group_size)
    if packed and not x.is_cuda:
        raise ValueError("the packed-halves INT4 GEMV is inline PTX: CUDA only")
    if packed and group_size < 32:
        raise ValueError(f"the packed-halves INT4 GEMV needs groups of 32 inputs or more, not {group_size}")
    if packed and max(qweight.storage_offset() + qweight.shape[0] * qweight.stride(0),
                      scales.storage_offset() + scales.shape[0] * scales.stride(0)) >= 2**31:
        raise ValueError("the packed-halves INT4 GEMV addresses its weights with 32-bit offsets")
    n_out, rows_a_program = check_gated(n, config.block_n) if silu_and_mul else (n, config.block_n)
    check_grid_rows(n_out, rows_a_program)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (m, triton.cdiv(n_out, rows_a_program) * split)
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"{n_out} output rows need more than {MAX_GRID_Y} programs of {rows_a_program} rows "
                         f"split {split} ways")
    common = (x, qweight, scales, zeros, bias if bias is not None else scales, out, n_out, words * PACK, x.stride(0),
              qweight.stride(0), scales.stride(0), out.stride(0), FLOAT_2_23_BITS)
    if by_groups:
        groups = config.block_k // group_size
        # No masks where every tile is full: whole tiles of rows (of gate/up pairs), whole steps of groups.
        even = n % config.block_n == 0 and (words * PACK // group_size) % groups == 0
        if packed:
            if config.num_stages not in (1, 2):
                raise ValueError(f"the packed-halves INT4 GEMV runs 1 or 2 stages, not {config.num_stages}")
            # With split > 1 the programs' partial sums and per-tile counters (one set per weight width).
            partials, counters = _packed_split_workspace(x.device, n, split) if split > 1 else (out, out)
            pdl = pdl_launch(x.device)
            _int4_packed_gemv_kernel[grid](
                x, qweight, scales, zeros, bias if bias is not None else scales, out, partials, counters, n_out,
                words * PACK, n, TC_GEMV_ROWS * n, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
                GROUP=group_size, BLOCK_N=config.block_n, GROUPS=groups,
                PREFETCH=config.num_stages == 2, HAS_BIAS=bias is not None, EVEN=even, SILU_AND_MUL=silu_and_mul,
                PAIRED=isinstance(config, PairedPackedGemvConfig), SPLIT=split, PDL=pdl,
                num_warps=config.num_warps, launch_pdl=pdl,
            )
        else:
            _int4_group_gemv_kernel[grid](
                *common, GROUP=group_size, BLOCK_N=config.block_n, GROUPS=groups, HAS_BIAS=bias is not None,
                EVEN=even, SILU_AND_MUL=silu_and_mul, num_warps=config.num_warps,
            )
        return out
    block_w = config.block_k // PACK
    _int4_gemv_kernel[grid](
        *common, GROUP=group_size, BLOCK_N=config.block_n, BLOCK_W=block_w, HAS_BIAS=bias is not None,
        EVEN=n % config.block_n == 0 and words % block_w == 0, num_warps=config.num_warps,
    )
    return out


@triton.jit
def _dequantize_nibbles(half, k: tl.constexpr, s, zs, magic):
    """Nibble ``k`` (0..3) of each int32 in ``half`` as ``(q - z) * s``: masked in place (worth
    ``q * 16^k``), read as a float through 2^23's mantissa, times ``s / 16^k``, minus ``z * s``.
    With 16-bit scales every step is exact: the weight equals the reference's, bit for bit."""
    place = (half & (0xF << (4 * k))) | magic
    return (place.to(tl.float32, bitcast=True) - 8388608.0) * (s * (1.0 / (1 << (4 * k)))) - zs


@triton.jit
def _nibble_minus_zero(half, k: tl.constexpr, z, magic):
    """Nibble ``k`` (0..3) of each int32 in ``half`` minus the zero point, ``q - z``, in one
    multiply-add: the masked nibble read through 2^23's mantissa is ``2^23 + q * 16^k``, and
    ``(2^23 + q 16^k) 16^-k - (2^23 16^-k + z)`` is exact (powers of two, integers below 2^24)."""
    place = (half & (0xF << (4 * k))) | magic
    return place.to(tl.float32, bitcast=True) * (1.0 / (1 << (4 * k))) - (8388608.0 / (1 << (4 * k)) + z)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    q_tile = q_ptr + cols.to(tl.int64)[:, None] * stride_qn + tl.arange(0, BLOCK_W)[None, :]  # [BLOCK_N, BLOCK_W]
    s_cols = s_ptr + cols.to(tl.int64) * stride_sn
    z_cols = z_ptr + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, GROUP of BLOCK_K: no K mask
        x = tl.load(x_tile + k0, mask=row_ok[:, None], other=0.0)
        words = tl.load(q_tile + k0 // 8, mask=col_ok[:, None], other=0)
        g = k0 // GROUP
        s = tl.load(s_cols + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        zs = tl.load(z_cols + g, mask=col_ok, other=0.0).to(tl.float32)[:, None] * s
        high = words >> 16
        w0 = _dequantize_nibbles(words, 0, s, zs, magic).to(x.dtype)
        w1 = _dequantize_nibbles(words, 1, s, zs, magic).to(x.dtype)
        w2 = _dequantize_nibbles(words, 2, s, zs, magic).to(x.dtype)
        w3 = _dequantize_nibbles(words, 3, s, zs, magic).to(x.dtype)
        w4 = _dequantize_nibbles(high, 0, s, zs, magic).to(x.dtype)
        w5 = _dequantize_nibbles(high, 1, s, zs, magic).to(x.dtype)
        w6 = _dequantize_nibbles(high, 2, s, zs, magic).to(x.dtype)
        w7 = _dequantize_nibbles(high, 3, s, zs, magic).to(x.dtype)
        # join stacks on a new last axis: this tree puts nibble i at position i of [.., word, 8],
        # so the reshape gives input 8j + i at column 8j + i.
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# The tensor-core GEMV: ``out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ x^T [K, BLOCK_M]``, the
# weights as the dot's first operand (registers), the few input rows padded to BLOCK_M = 16 as
# its second. A step (inside one group) turns a [BLOCK_N, BLOCK_K] tile of nibbles into the
# integers q - z, exact in bf16/fp16 (|q - z| <= 15), in one multiply-add each, takes one dot
# (exact products, fp32 sums) and scales its sums by the group's scale in fp32: no less exact
# than the reference, which rounds each (q - z) * s to 16 bits first. With SPLIT > 1 the program runs K/SPLIT
# of the inputs and adds its fp32 partial sums into ``ws_ptr`` (``[BLOCK_M, N]``, zero between
# calls); the last program of a column tile (``cnt_ptr`` counts them) reads the sums back
# through L2, zeroes them, writes the output and resets its counter, so the workspace is clean
# for the next call (and the next CUDA-graph replay) without a memset.
@triton.jit
def _int4_tc_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    magic,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    tile = tl.program_id(0)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    cols64 = cols.to(tl.int64)
    q_tile = q_ptr + cols64[:, None] * stride_qn + tl.arange(0, BLOCK_W)[None, :]  # [BLOCK_N, BLOCK_W]
    s_cols = s_ptr + cols64 * stride_sn
    z_cols = z_ptr + cols64 * stride_sn
    x_tile = x_ptr + m.to(tl.int64)[None, :] * stride_xm + tl.arange(0, BLOCK_K)[:, None]  # x^T [BLOCK_K, BLOCK_M]
    k_per_program = K // SPLIT  # a multiple of BLOCK_K (checked by the caller)
    k_start = tl.program_id(1) * k_per_program
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_start, k_start + k_per_program, BLOCK_K, num_stages=STAGES):
        words = tl.load(q_tile + k0 // 8, mask=col_ok[:, None], other=0)
        xt = tl.load(x_tile + k0, mask=m_ok[None, :], other=0.0)
        g = k0 // GROUP
        s = tl.load(s_cols + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_cols + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        high = words >> 16
        # Integer weights q - z (exact in 16 bits); the group's scale goes on the dot's sums.
        w0 = _nibble_minus_zero(words, 0, z, magic).to(xt.dtype)
        w1 = _nibble_minus_zero(words, 1, z, magic).to(xt.dtype)
        w2 = _nibble_minus_zero(words, 2, z, magic).to(xt.dtype)
        w3 = _nibble_minus_zero(words, 3, z, magic).to(xt.dtype)
        w4 = _nibble_minus_zero(high, 0, z, magic).to(xt.dtype)
        w5 = _nibble_minus_zero(high, 1, z, magic).to(xt.dtype)
        w6 = _nibble_minus_zero(high, 2, z, magic).to(xt.dtype)
        w7 = _nibble_minus_zero(high, 3, z, magic).to(xt.dtype)
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        acc += s * tl.dot(tl.reshape(w, (BLOCK_N, BLOCK_K)), xt)
    ok = col_ok[:, None] & m_ok[None, :]
    out = out_ptr + m.to(tl.int64)[None, :] * stride_om + cols64[:, None]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        ws = ws_ptr + m.to(tl.int64)[None, :] * N + cols64[:, None]
        tl.atomic_add(ws, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are issued before the count says so
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:  # the last program of this column tile
            # Read through L2 (an atomic add of 0: no stale L1 line), then zero for the next call.
            y = tl.atomic_add(ws, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), mask=ok, sem="acquire")
            tl.store(ws, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), mask=ok)
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(cnt_ptr + tile, 0)


TC_GEMV_ROWS = 16  # the tensor-core GEMV pads its input rows to one dot tile
_split_workspaces: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed fp32 partial sums ``[TC_GEMV_ROWS, n]`` and the column-tile counters of the
    split-K GEMV on ``device``, one pair per output width, made on the first (eager) call and
    kept clean by the kernel itself. Calls that share them run one after the other on a stream."""
    key = (device, n)
    if key not in _split_workspaces:
        if stream_capturing():
            # A graph's own allocation is zeroed only when it replays: others would read garbage.
            raise RuntimeError("a split-K INT4 GEMV ran first inside a CUDA-graph capture; run it once "
                               "before (Int4LinearMethod.warm_up does)")
        _split_workspaces[key] = (torch.zeros(TC_GEMV_ROWS * n, dtype=torch.float32, device=device),
                                  torch.zeros(n, dtype=torch.int32, device=device))
    return _split_workspaces[key]


_packed_split_workspaces: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _packed_split_workspace(device: torch.device, n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K packed GEMV's fp32 partial sums ``[split, TC_GEMV_ROWS, n]`` (written before
    they are read: never cleared) and its zeroed per-tile counters (``TC_GEMV_ROWS * n``: at least
    one per input row and tile) on ``device``, one pair per weight width and
    split, made on the first (eager) call; the kernel resets each counter it finishes. Calls that
    share them run one after the other on a stream."""
    key = (device, n, split)
    if key not in _packed_split_workspaces:
        if stream_capturing():
            raise RuntimeError("a split-K packed INT4 GEMV ran first inside a CUDA-graph capture; run it once "
                               "before (Int4LinearMethod.warm_up does)")
        _packed_split_workspaces[key] = (torch.empty(split * TC_GEMV_ROWS * n, dtype=torch.float32, device=device),
                                         torch.zeros(TC_GEMV_ROWS * n, dtype=torch.int32, device=device))
    return _packed_split_workspaces[key]


def _int4_tc_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None, config: TcGemvConfig) -> torch.Tensor:
    n, words = qweight.shape
    k = words * PACK
    m = x.shape[0]
    if m > TC_GEMV_ROWS:
        raise ValueError(f"the tensor-core GEMV takes up to {TC_GEMV_ROWS} rows, not {m}")
    if group_size % config.block_k or config.block_k % 16 or k % (config.block_k * config.split_k):
        raise ValueError(f"block_k {config.block_k} × split {config.split_k} does not tile {k} inputs in "
                         f"groups of {group_size}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if config.split_k > 1:
        ws, counters = _split_workspace(x.device, n)
    else:
        ws, counters = out, out  # unused
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _int4_tc_gemv_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, ws, counters, m, n, k, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), FLOAT_2_23_BITS, GROUP=group_size,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_M=TC_GEMV_ROWS, SPLIT=config.split_k,
        STAGES=config.num_stages, HAS_BIAS=bias is not None, num_warps=config.num_warps,
    )
    return out


# Rows at which each GEMM tile class starts (gemm_tiles); one input of each compiles them all.
GEMM_TILE_ROWS = (1, 17, 257)


def gemm_tiles(m: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows. Three classes, compiled
    together before the decode graphs are captured (``GEMM_TILE_ROWS``):
    - up to 16 rows (decode batches): a weight read, so narrow column tiles give many programs;
    - up to 256 (a short prefill, larger decode batches): 64 × 64, still two programs an SM on
      the Qwen3-8B shapes at 128 rows;
    - more (long prefills): 128 × 128, bound by the tensor cores."""
    block_k = next((b for b in (128, 64, 32, 16) if group_size % b == 0), 0)
    if not block_k:
        raise ValueError(f"the INT4 GEMM needs a group size that is a multiple of 16, not {group_size}")
    if m <= 16:
        return 16, 32, block_k, 4, 4
    if m <= 256:
        return 64, 64, block_k, 4, 3
    return 128, 128, min(block_k, 64), 8, 3


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T (+ bias)`` → ``[M, N]`` in x's dtype (fp32 accumulation)."""
    _check(x, qweight, scales, zeros, group_size)
    n, words = qweight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles or gemm_tiles(m, group_size)
    if group_size % block_k or block_k % 16:
        raise ValueError(f"BLOCK_K {block_k} must be a multiple of 16 that divides the group size {group_size}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, m, n, words * PACK, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), FLOAT_2_23_BITS, GROUP=group_size, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
    )
    return out


__all__ = ["GEMM_TILE_ROWS", "INT4_GEMV_CONFIGS", "GroupGemvConfig", "PackedGemvConfig", "PairedPackedGemvConfig",
           "TcGemvConfig", "gemm_tiles", "int4_gemm",
           "int4_gemv", "int4_tile_folds_silu_and_mul"]
