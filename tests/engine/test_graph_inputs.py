"""A decode graph's inputs in one launch (kernels/triton/graph_inputs.py): the staged scalars with
the fed tokens in place and the step's block-table rows, equal to the ops it replaces (the feed's
gather and scatter, the scalars' copy, the block-table gather and copy). CPU: Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from tidal_engine.kernels.triton.graph_inputs import stage_decode_graph  # noqa: E402
from tidal_engine.runner.input_buffers import packed_offsets  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU: Triton's interpreter")


def _staged(b: int, feed_rows: list[int], feed_src: list[int], batch_rows: list[int], seed: int) -> tuple[torch.Tensor, dict]:
    off = packed_offsets(b, b, b, len(feed_rows), 0)
    g = torch.Generator().manual_seed(seed)
    staged = torch.randint(0, 1000, (off["feed_drafts"][1] + 5,), generator=g)
    for name, values in (("feed_rows", feed_rows), ("feed_src", feed_src), ("batch_rows", batch_rows)):
        a, e = off[name]
        staged[a:e] = torch.tensor(values, dtype=torch.int64)
    return staged, off


@interpreted
@pytest.mark.parametrize("b, feed_rows, feed_src, batch_rows, width", [
    (1, [0], [3], [2], 5),  # one stream, its token fed
    (3, [0, 2], [5, 1], [4, 0, 1], 7),  # a padding row (table row 0), one row not fed
    (4, [], [], [1, 2, 3, 4], 1),  # nothing fed (the host knew every token)
    (2, [1], [0], [3, 1], 1500),  # a block-table row longer than a loop step
])
def test_one_launch_equals_the_ops_it_replaces(b: int, feed_rows: list[int], feed_src: list[int],
                                               batch_rows: list[int], width: int) -> None:
    staged, off = _staged(b, feed_rows, feed_src, batch_rows, seed=b)
    end = packed_offsets(b, b, 0, 0)["query_start_loc"][1]
    last_sampled = torch.randint(0, 50000, (8,), generator=torch.Generator().manual_seed(9))
    table = torch.randint(0, 99, (6, 1600), generator=torch.Generator().manual_seed(10))
    scalars = torch.full((end + 3,), -7, dtype=torch.int64)
    block_tables = torch.full((5, 1600), -7, dtype=torch.int64)

    want_scalars, want_tables = scalars.clone(), block_tables.clone()
    fed = staged.clone()
    if feed_rows:
        fed[torch.tensor(feed_rows)] = last_sampled[torch.tensor(feed_src)]
    want_scalars[:end] = fed[:end]
    want_tables[:b, :width] = table[torch.tensor(batch_rows), :width]

    stage_decode_graph(staged, end, scalars, (off["feed_rows"][0], off["feed_src"][0], len(feed_rows)), last_sampled,
                       table, off["batch_rows"][0], b, width, block_tables)
    assert torch.equal(scalars, want_scalars)
    assert torch.equal(block_tables, want_tables)


def test_refuses_what_does_not_fit() -> None:
    staged = torch.zeros(64, dtype=torch.int64)
    scalars, tables = torch.zeros(8, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_graph(staged, 9, scalars, (0, 0, 0), staged, tables, 0, 1, 1, tables)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_graph(staged, 8, scalars, (0, 0, 0), staged, tables, 0, 1, 5, tables)
    with pytest.raises(ValueError, match="int64"):
        stage_decode_graph(staged.int(), 8, scalars, (0, 0, 0), staged, tables, 0, 1, 1, tables)
