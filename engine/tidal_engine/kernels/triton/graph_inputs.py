"""A decode graph's inputs in one launch: the step's packed scalars into the graph's static buffer
with the fed tokens in place, and the step's rows of the persistent block table into the graph's
table. Between two decode graphs of one stream these were five small ops (the feed's gather and
scatter, two copies, the block-table gather), each a launch the GPU waited on
(benchmarks/results/h200-2026-12-02-tenth: 38 us between graphs, 24 of them idle).

Program ``i < num_seqs`` copies block-table row ``batch_rows[i]``'s first ``width`` entries; the
last program copies ``staged[:num_scalars]`` (input_ids first: runner/input_buffers.py's layout)
and then, after a barrier (the same program stored the placeholder it overwrites), sets
``input_ids[feed_rows[j]] = last_sampled[feed_src[j]]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stage_decode_graph"]

_BLOCK = 1024  # int64 entries a loop step copies


# Every integer unspecialised: one compile serves every bucket and layout (start-up makes it).
@triton.jit(do_not_specialize=["num_scalars", "feed_rows_at", "feed_src_at", "num_feeds", "stride_table",
                               "batch_rows_at", "num_seqs", "width", "stride_bt"])
def _stage_decode_graph_kernel(
    staged_ptr,
    scalars_ptr,
    num_scalars,
    feed_rows_at,
    feed_src_at,
    num_feeds,
    last_sampled_ptr,
    table_ptr,
    stride_table,
    batch_rows_at,
    num_seqs,
    width,
    bt_ptr,
    stride_bt,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    if pid < num_seqs:
        row = tl.load(staged_ptr + batch_rows_at + pid)
        src = table_ptr + row * stride_table
        dst = bt_ptr + pid.to(tl.int64) * stride_bt
        for c0 in range(0, width, BLOCK):
            c = c0 + i
            tl.store(dst + c, tl.load(src + c, mask=c < width).to(bt_ptr.dtype.element_ty), mask=c < width)
    else:
        for c0 in range(0, num_scalars, BLOCK):
            c = c0 + i
            tl.store(scalars_ptr + c, tl.load(staged_ptr + c, mask=c < num_scalars), mask=c < num_scalars)
        tl.debug_barrier()  # the placeholders above are stored before the fed tokens overwrite them
        for f0 in range(0, num_feeds, BLOCK):
            f = f0 + i
            fed = f < num_feeds
            rows = tl.load(staged_ptr + feed_rows_at + f, mask=fed, other=0)
            token = tl.load(last_sampled_ptr + tl.load(staged_ptr + feed_src_at + f, mask=fed, other=0), mask=fed)
            tl.store(scalars_ptr + rows, token, mask=fed)


def stage_decode_graph(
    staged: torch.Tensor,
    num_scalars: int,
    scalars: torch.Tensor,
    feeds: tuple[int, int, int],
    last_sampled: torch.Tensor,
    table: torch.Tensor,
    batch_rows_at: int,
    num_seqs: int,
    width: int,
    block_tables: torch.Tensor,
) -> None:
    """``scalars[:num_scalars] = staged[:num_scalars]`` with ``scalars[feed_rows[j]] =
    last_sampled[feed_src[j]]`` (``feeds = (feed_rows start, feed_src start, count)`` in
    ``staged``), and ``block_tables[i, :width] = table[staged[batch_rows_at + i], :width]`` for
    ``i < num_seqs``: all int64 except ``table``/``block_tables`` (any integer dtype), contiguous
    last dims, on one device."""
    for name, t in (("staged", staged), ("scalars", scalars), ("last_sampled", last_sampled)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous int64 vector, not {t.dtype} {tuple(t.shape)}")
    if table.dim() != 2 or block_tables.dim() != 2 or table.stride(1) != 1 or block_tables.stride(1) != 1:
        raise ValueError("table and block_tables must be 2-D with contiguous rows")
    if num_scalars > scalars.shape[0] or num_seqs > block_tables.shape[0] or width > min(table.shape[1],
                                                                                          block_tables.shape[1]):
        raise ValueError(f"{num_scalars} scalars, {num_seqs} rows of {width} blocks do not fit the graph's buffers")
    feed_rows_at, feed_src_at, num_feeds = feeds
    _stage_decode_graph_kernel[(num_seqs + 1,)](
        staged, scalars, num_scalars, feed_rows_at, feed_src_at, num_feeds, last_sampled, table, table.stride(0),
        batch_rows_at, num_seqs, width, block_tables, block_tables.stride(0), BLOCK=_BLOCK, num_warps=4,
    )
