"""FP8 (e4m3) kernels for the W8A8 linear (quantization/fp8.py).

- ``fp8_gemv``: ``y = x (W * scale)^T + b`` for a few rows of 16-bit activations and e4m3
  weights with one fp32 scale per output row. Decode at batch 1 is a pure weight read, so
  halving the weight bytes is the whole gain; the weights are widened in registers,
  multiplied in fp32, and the row scale is applied once after the reduction. The
  activations are not quantized here (W8A16), which is slightly more exact than the W8A8
  path of larger batches. Each program takes ``BLOCK_N`` output rows of one input row;
  the input rows' programs of one weight tile run next to each other (input row is the
  fastest grid axis), so a few rows read the weights from HBM about once. An fp8 tile holds
  half the bytes of a bf16 one, so a program keeps fewer bytes in flight for the registers
  its accumulator costs; ``num_stages`` > 1 software-pipelines the K loop (the weight and
  activation tiles stream through shared memory that many iterations ahead, by cp.async).
  ``split_k`` > 1 gives each output tile that many programs, each over a run of K: a 4096-row
  matrix in 8-row tiles is only 512 programs, under 4 an SM, which keeps too few bytes in
  flight. The splits meet in one kernel (partials in a scratch, an arrival counter per tile;
  the last to arrive adds them in a fixed order), so a linear stays one launch, deterministic
  and CUDA-graph safe, with no zeroing or reduction kernel around it. ``pdl`` launches the
  kernel with programmatic dependent launch (Hopper): its programs may be scheduled while the
  previous kernel (the norm, attention or activation producing x) is still finishing, and wait
  for it (``griddepcontrol.wait``) before reading x; with 2 they first prefetch their first
  weight lines into L2, which no previous kernel writes.
- ``quantize_rows_fp8``: dynamic per-token activation quantization in one kernel (absmax of
  the row → scale = absmax / 448 → e4m3), in front of ``torch._scaled_mm`` for larger batches.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton.gemv import GemvConfig, check_grid_rows

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without programmatic dependent launch (before 3.4): pdl candidates run plain
    gdc_wait = None

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)  # an all-zero row still gets a finite scale (as quantization/fp8.py)



@dataclass(frozen=True)
class Fp8GemvConfig(GemvConfig):
    """A GemvConfig with ``num_stages`` (1 is the plain loop, more pipelines it) and ``split_k``
    (more than 1: that many programs share an output tile, each summing a run of K)."""

    num_stages: int = 1
    split_k: int = 1
    pdl: int = 0  # 1: launched early (programmatic dependent launch); 2: also prefetch weights meanwhile


# The candidates timed at start-up (kernels/gemv_choice.py): one byte a weight, so wider K
# tiles. On the H200 (2026-12-01c) a 3-stage (8, 512, 4) won every 8B shape at one row, yet read
# only 2.3 TB/s on 4096 x 4096 and 3.2 on 4096 x 12288: 512 programs of 8 rows are under 4 an SM,
# too few bytes in flight. Deeper pipelines, smaller programs (2 warps) and split K each put
# more in flight; ``pdl`` twins of the likeliest ones overlap the launch with the previous
# kernel. The old candidates never within 10% of the best at one or four rows are gone.
FP8_GEMV_CONFIGS: tuple[Fp8GemvConfig, ...] = (
    Fp8GemvConfig(4, 1024, 4),
    Fp8GemvConfig(8, 512, 4),
    Fp8GemvConfig(2, 2048, 4, 2),
    Fp8GemvConfig(4, 1024, 4, 3),
    Fp8GemvConfig(8, 512, 4, 3),
    Fp8GemvConfig(8, 1024, 4, 2),
    Fp8GemvConfig(16, 512, 8, 3),
    Fp8GemvConfig(8, 512, 4, 4),
    Fp8GemvConfig(8, 512, 4, 6),
    Fp8GemvConfig(8, 1024, 4, 4),
    Fp8GemvConfig(16, 512, 8, 5),
    Fp8GemvConfig(4, 512, 2, 6),
    Fp8GemvConfig(8, 512, 4, 3, split_k=2),
    Fp8GemvConfig(8, 512, 4, 5, split_k=2),
    Fp8GemvConfig(8, 512, 4, 4, split_k=3),
    Fp8GemvConfig(16, 512, 8, 3, split_k=2),
    Fp8GemvConfig(8, 256, 2, 6, split_k=2),
    Fp8GemvConfig(4, 512, 2, 4, split_k=2),
    Fp8GemvConfig(8, 512, 4, 3, pdl=1),
    Fp8GemvConfig(8, 512, 4, 3, pdl=2),
    Fp8GemvConfig(8, 512, 4, 6, pdl=2),
    Fp8GemvConfig(4, 512, 2, 6, pdl=2),
    Fp8GemvConfig(8, 512, 4, 3, split_k=2, pdl=2),
    Fp8GemvConfig(8, 512, 4, 4, split_k=3, pdl=2),
)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    m = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    split = tl.program_id(2)
    if SPLIT_K == 1:
        k_start = 0
        k_end = K
    else:
        # Split s sums K's run [s * span, (s + 1) * span); span is whole K tiles, so runs share none.
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_start = split * span
        k_end = tl.minimum(k_start + span, K)
    if PDL == 2:
        # Launched before the previous kernel has finished: the weights are not its output, so
        # their first 128-byte lines (up to 2 KiB a row) start towards L2 now.
        line = k_start + tl.arange(0, 16) * 128
        first = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn \
            + tl.minimum(line, k_end - 1)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [first], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL != 0:
        gdc_wait()  # x is the previous kernel's output: wait for all of it
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    store_ok = row_ok
    if SPLIT_K > 1:
        # Each split leaves its partial sums in the scratch; the split that arrives last at the
        # tile's counter adds all of them in split order (the result does not depend on who came
        # last) and finishes the tile, then zeroes the counter for the next launch or graph replay.
        slot = m * tl.num_programs(1) + tile
        parts = part_ptr + slot.to(tl.int64) * (SPLIT_K * BLOCK_N) + tl.arange(0, BLOCK_N)
        tl.store(parts + split * BLOCK_N, y)
        tl.debug_barrier()  # every thread's partials are written before the counter moves (release)
        last = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        y = tl.zeros([BLOCK_N], tl.float32)
        for s in tl.static_range(SPLIT_K):  # read through L2: another SM wrote them
            y += tl.load(parts + s * BLOCK_N, mask=row_ok & last, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + slot, 0, mask=last)
        store_ok = row_ok & last
    y = y * tl.load(s_ptr + rows, mask=store_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=store_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=store_ok)


# Split-K scratch per device: the partial sums and one arrival counter per (input row, output
# tile). Counters start at zero and every launch leaves them at zero, so one scratch serves every
# split launch of the device in turn (launches of one stream never overlap; the engine decodes on
# one stream). It only grows, and a grown-out scratch is kept: a captured CUDA graph holds its address.
_SPLIT_SCRATCH: dict[tuple[str, int | None], list[tuple[torch.Tensor, torch.Tensor]]] = {}
_MIN_SCRATCH_PARTS = 1 << 20  # float32 partials: 4 MiB (the 8B shapes at 4 rows and 4 splits need 1.5)
_MIN_SCRATCH_SLOTS = 1 << 16  # int32 counters


def split_scratch(device: torch.device, slots: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials of at least ``parts``, zeroed int32 counters of at least ``slots``) on ``device``."""
    held = _SPLIT_SCRATCH.setdefault((device.type, device.index), [])
    if held and held[-1][0].numel() >= parts and held[-1][1].numel() >= slots:
        return held[-1]
    scratch = (torch.empty(max(triton.next_power_of_2(parts), _MIN_SCRATCH_PARTS), dtype=torch.float32, device=device),
               torch.zeros(max(triton.next_power_of_2(slots), _MIN_SCRATCH_SLOTS), dtype=torch.int32, device=device))
    held.append(scratch)
    return scratch


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig) -> torch.Tensor:
    """``x [M, K]`` (16/32-bit) @ ``(weight [N, K] e4m3 * scale [N, 1])^T (+ bias)`` → ``[M, N]`` in x's dtype.
    ``config``: a GemvConfig, or an Fp8GemvConfig to pipeline the loop or split K."""
    if x.dim() != 2:
        raise ValueError(f"fp8_gemv takes x of shape [M, K]; got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects {k}")
    if weight.stride(1) != 1 or scale.numel() != n:
        raise ValueError("weight's last dim must be contiguous and scale must hold one value per output row")
    check_grid_rows(n, config.block_n)
    split_k = getattr(config, "split_k", 1)
    if split_k > 1 and -(-k // config.block_k) < split_k:
        raise ValueError(f"{k} inputs are fewer than {split_k} K tiles of {config.block_k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, config.block_n)
    if split_k > 1:
        parts, counts = split_scratch(x.device, m * tiles, m * tiles * split_k * config.block_n)
    else:
        parts, counts = scale, scale  # not read
    pdl = getattr(config, "pdl", 0) if _pdl_launch_possible(x.device) else 0
    launch = {"launch_pdl": True} if pdl else {}  # only then: a plain launch stays what it was
    _fp8_gemv_kernel[(m, tiles, split_k)](
        x, weight, scale, bias if bias is not None else scale, out, parts, counts, n, k, x.stride(0),
        weight.stride(0), out.stride(0), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None, STAGES=getattr(config, "num_stages", 1), SPLIT_K=split_k, PDL=pdl,
        num_warps=config.num_warps, **launch,
    )
    return out


@functools.cache
def _pdl_launch_possible(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on compute capability 9.0+ with a Triton
    that has it. Elsewhere (the CPU interpreter too) a ``pdl`` config runs as a plain launch,
    with the same numbers."""
    return (gdc_wait is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device) >= (9, 0))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):  # the second read of the row comes from L1/L2
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows_fp8(x: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``[M, K]`` e4m3, float32 scale ``[M, 1]``) with ``x ≈ q * scale``, as
    quantization/fp8.py's ``quantize_tokens``. ``out_dtype=float32`` stores the scaled, clamped
    values before the e4m3 rounding (the CPU interpreter's e4m3 rounding is not exact)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 takes x of shape [M, K]; got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block,
                                num_warps=8 if block >= 2048 else 4)
    return q, scale


__all__ = ["FP8_GEMV_CONFIGS", "Fp8GemvConfig", "fp8_gemv", "quantize_rows_fp8", "split_scratch"]
