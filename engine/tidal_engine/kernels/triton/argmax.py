"""Row-wise argmax in one split launch: the greedy sampler's token pick.

``logits.argmax(dim=-1)`` on a [1, 151936] row runs one block over the whole row in torch (8 us
on an H200: 600 KB read at ~75 GB/s), the largest op between two decode graphs of one greedy
stream. Here a grid (rows, chunks) spreads each row over many programs: every program reduces
its chunk of columns to (max, first index) and stores that pair to a workspace; the last program
of its row to finish (an acq_rel counter per row says which) reduces the row's pairs and writes
the row's index, then resets the counter to 0, so no memset runs between calls and the kernel
is safe inside CUDA graphs and on their replays.

Semantics are torch.argmax's: the first index of the maximum, a NaN counts as larger than any
number (so the first NaN wins), -0.0 equals 0.0, and an all -inf row gives index 0. The order
``_better`` defines is total on (value, index) pairs, so the answer does not depend on how the
reductions are grouped or which program finished last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_engine.kernels.triton._common import FLOAT_DTYPES, check_dtype, pdl_launch, pdl_wait, stream_capturing

__all__ = ["argmax_rows", "default_chunk"]

MAX_GRID_Y = 65535  # CUDA's limit on grid dimension 1
MAX_BLOCK = 2048  # columns a program loads at once: at 4 warps, 16 a thread in flight


@triton.jit
def _better(v1, i1, v2, i2):
    """The better of two (value, index) pairs: the larger value (NaN above all, NaNs equal),
    on equal values the smaller index."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    greater = (v1 > v2) | (nan1 & ~nan2)
    equal = (v1 == v2) | (nan1 & nan2)
    take1 = greater | (equal & (i1 < i2))
    return tl.where(take1, v1, v2), tl.where(take1, i1, i2)


# V and the row stride keep Triton's default specialisation (divisible by 16 or not, never the
# value): one compile serves every vocabulary of a run, and a vocabulary that is a multiple of 16
# keeps 16-byte loads under the column mask.
@triton.jit
def _argmax_rows_kernel(
    x_ptr,
    out_ptr,
    ws_val_ptr,
    ws_idx_ptr,
    cnt_ptr,
    V,
    stride_xm,
    ws_stride,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr = False,
    scatter_ptr=None,
    scatter_index_ptr=None,
    SCATTER: tl.constexpr = False,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunks = tl.num_programs(1)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    cols = part * CHUNK + tl.arange(0, BLOCK)
    pdl_wait(PDL)  # the logits are the previous kernel's output
    # Per lane: the best (value, index) of the columns it saw; masked columns are -inf at an
    # index past V, so they lose every tie against a real column.
    best_v = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best_i = cols
    for b in tl.static_range(1, CHUNK // BLOCK):
        c = cols + b * BLOCK
        v = tl.load(x_row + c, mask=c < V, other=float("-inf")).to(tl.float32)
        best_v, best_i = _better(best_v, best_i, v, c)
    chunk_v, chunk_i = tl.reduce((best_v, best_i), 0, _better)
    ws = row.to(tl.int64) * ws_stride + part
    tl.store(ws_val_ptr + ws, chunk_v)
    tl.store(ws_idx_ptr + ws, chunk_i)
    tl.debug_barrier()  # the pair is stored before the count says so
    done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if done == chunks - 1:  # the row's last program: reduce every chunk's pair, in a fixed order
        # PAIRS at a time, whatever the number of chunks (one compile for every vocabulary);
        # through L2 (.cg): other programs wrote them, this SM's L1 may hold stale lines.
        p = tl.arange(0, PAIRS)
        pair_v_row = ws_val_ptr + row.to(tl.int64) * ws_stride
        pair_i_row = ws_idx_ptr + row.to(tl.int64) * ws_stride
        row_v = tl.full([PAIRS], float("-inf"), tl.float32)
        row_i = tl.full([PAIRS], 2147483647, tl.int32)
        for p0 in range(0, chunks, PAIRS):
            q = p0 + p
            pair_v = tl.load(pair_v_row + q, mask=q < chunks, other=float("-inf"), cache_modifier=".cg")
            pair_i = tl.load(pair_i_row + q, mask=q < chunks, other=2147483647, cache_modifier=".cg")
            row_v, row_i = _better(row_v, row_i, pair_v, pair_i)
        _, index = tl.reduce((row_v, row_i), 0, _better)
        tl.store(out_ptr + row, index.to(tl.int64))
        if SCATTER:  # and into its slot of another tensor: scatter[scatter_index[row]] = index
            tl.store(scatter_ptr + tl.load(scatter_index_ptr + row), index.to(scatter_ptr.dtype.element_ty))
        tl.store(cnt_ptr + row, 0)


class _Workspace:
    """Per-row partial (max, index) pairs ``[rows, chunks]`` (written before they are read:
    never cleared) and the zeroed per-row counters, which the kernel resets itself."""

    def __init__(self, device: torch.device, rows: int, chunks: int) -> None:
        self.rows, self.chunks = rows, chunks
        self.values = torch.empty(rows * chunks, dtype=torch.float32, device=device)
        self.indices = torch.empty(rows * chunks, dtype=torch.int32, device=device)
        self.counters = torch.zeros(rows, dtype=torch.int32, device=device)


_workspaces: dict[torch.device, _Workspace] = {}
# Outgrown workspaces stay allocated: a CUDA graph captured with one keeps its addresses.
_retired: list[_Workspace] = []


def _workspace(device: torch.device, rows: int, chunks: int) -> _Workspace:
    """The device's workspace, grown to at least ``rows`` x ``chunks`` (on an eager call only).
    Calls that share it run one after the other on a stream."""
    ws = _workspaces.get(device)
    if ws is None or ws.rows < rows or ws.chunks < chunks:
        if stream_capturing():
            # A graph's own allocation would hold garbage counters until the graph replays.
            raise RuntimeError(f"argmax_rows first ran on {rows} rows of {chunks} chunks inside a CUDA-graph "
                               f"capture; call it once eagerly with at least that shape before capturing")
        if ws is not None:
            _retired.append(ws)
            rows, chunks = max(rows, ws.rows), max(chunks, ws.chunks)
        ws = _workspaces[device] = _Workspace(device, rows, chunks)
    return ws


def default_chunk(element_size: int) -> int:
    """Columns a program reduces: 8 KB of logits (2048 fp32, 4096 bf16), so a 151936-token row
    spreads over 75 (fp32) or 38 (bf16) programs, under one per SM of an H200."""
    return 8192 // element_size


def argmax_rows(logits: torch.Tensor, *, chunk: int | None = None, force_kernel: bool = False,
                scatter_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``logits`` [M, V] (fp32, bf16 or fp16) as int64 [M], with
    torch's semantics (first index of the maximum, NaN the largest), in one launch on CUDA.

    ``chunk`` (a power of two) overrides the columns a program reduces. Off CUDA this is torch's
    argmax unless ``force_kernel`` (tests run the kernel in Triton's interpreter).
    ``scatter_into = (dest, index)``: also ``dest[index[i]] = result[i]`` (``dest`` a 1-D int64
    tensor, ``index`` int64 [M]: the persistent batch's last sampled token of each row), in the
    same launch."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows takes logits of shape [M, V] with V >= 1; got {tuple(logits.shape)}")
    if scatter_into is not None:
        dest, index = scatter_into
        if dest.dim() != 1 or dest.dtype != torch.int64 or index.dtype != torch.int64 or index.shape != logits.shape[:1]:
            raise ValueError(f"scatter_into takes an int64 [R] tensor and int64 indices [{logits.shape[0]}]; got "
                             f"{dest.dtype} {tuple(dest.shape)} and {index.dtype} {tuple(index.shape)}")
    if not (logits.is_cuda or force_kernel):
        out = logits.argmax(dim=-1)
        if scatter_into is not None:
            scatter_into[0].index_copy_(0, scatter_into[1], out)
        return out
    check_dtype("logits", logits, FLOAT_DTYPES)
    m, v = logits.shape
    if v >= 2**31:
        raise ValueError(f"argmax_rows indexes columns with int32; {v} columns are too many")
    chunk = chunk or default_chunk(logits.element_size())
    if chunk & (chunk - 1) or chunk < 16:
        raise ValueError(f"chunk must be a power of two >= 16, not {chunk}")
    out = torch.empty(m, dtype=torch.int64, device=logits.device)
    if m == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(v, chunk)
    if chunks > MAX_GRID_Y:
        raise ValueError(f"{v} columns need more than {MAX_GRID_Y} chunks of {chunk}; pass a larger chunk")
    ws = _workspace(logits.device, m, chunks)
    pdl = pdl_launch(logits.device)
    block = min(chunk, MAX_BLOCK)
    _argmax_rows_kernel[(m, chunks)](
        logits, out, ws.values, ws.indices, ws.counters, v, logits.stride(0), ws.chunks,
        CHUNK=chunk, BLOCK=block, PAIRS=128, PDL=pdl,
        **({} if scatter_into is None else
           {"scatter_ptr": scatter_into[0], "scatter_index_ptr": scatter_into[1], "SCATTER": True}),
        num_warps=4, launch_pdl=pdl,
    )
    return out
