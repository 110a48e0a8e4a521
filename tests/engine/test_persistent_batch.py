"""The persistent batch: rows, growth, and the device mirror of the block table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal_engine.runner.persistent_batch import PersistentBatch


def _batch(rows: int = 2, max_model_len: int = 64, block_size: int = 4) -> PersistentBatch:
    return PersistentBatch(rows, max_model_len, block_size, torch.device("cpu"), initial_token_capacity=16)


def _sync(batch: PersistentBatch) -> None:
    index, value = batch.take_block_updates()
    batch.apply_block_updates(torch.from_numpy(index), torch.from_numpy(value))


def test_rows_are_reused_lowest_first_and_row_zero_stays_zero() -> None:
    batch = _batch()
    assert batch.add("a", [1, 2, 3], [5]) == 1
    assert batch.add("b", [4], [6]) == 2
    batch.remove("a")
    assert batch.add("c", [7], [8, 9]) == 1
    _sync(batch)
    assert batch.tokens("c") == [7] and batch.blocks("c") == [8, 9]
    assert batch.block_table_dev[1, :2].tolist() == [8, 9]
    assert (batch.block_table[0] == 0).all() and (batch.block_table_dev[0] == 0).all()
    with pytest.raises(ValueError):
        batch.add("c", [1], [1])


def test_growth_keeps_rows_and_device_entries() -> None:
    batch = _batch(rows=1)
    batch.add("a", list(range(10)), [3, 4, 5])
    _sync(batch)
    batch.add("b", list(range(30)), list(range(10, 18)))  # a new row and more token columns
    assert batch.capacity >= 2 and batch.token_capacity > 30
    _sync(batch)
    assert batch.tokens("a") == list(range(10)) and batch.tokens("b") == list(range(30))
    assert batch.block_table_dev[1, :3].tolist() == [3, 4, 5]
    assert batch.block_table_dev[2, :8].tolist() == list(range(10, 18))


def test_only_changed_entries_are_shipped_and_the_last_write_wins() -> None:
    batch = _batch()
    row = batch.add("a", [1], [3])
    _sync(batch)
    assert batch.take_block_updates()[0].size == 0  # nothing changed: nothing to upload
    batch.append_blocks(row, [4])
    index, value = batch.take_block_updates()
    assert index.tolist() == [row * batch.max_blocks_per_seq + 1] and value.tolist() == [4]
    batch.append_blocks(row, [6])
    batch.replace_blocks(row, [9, 8])  # a resume after preemption, before any upload
    index, value = batch.take_block_updates()
    w = batch.max_blocks_per_seq
    shipped = dict(zip(index.tolist(), value.tolist()))
    assert len(shipped) == len(index) and shipped[row * w] == 9 and shipped[row * w + 1] == 8
    batch.apply_block_updates(torch.from_numpy(index), torch.from_numpy(value))
    assert batch.block_table_dev[row, :2].tolist() == [9, 8] and batch.blocks("a") == [9, 8]


def test_append_tokens_grows_columns() -> None:
    batch = _batch()
    a = batch.add("a", list(range(15)), [1, 2, 3, 4])
    b = batch.add("b", [7], [5])
    for step in range(5):
        batch.append_tokens(np.array([a, b]), [100 + step, 200 + step])
    assert batch.tokens("a") == list(range(15)) + [100, 101, 102, 103, 104]
    assert batch.tokens("b") == [7, 200, 201, 202, 203, 204]
    assert batch.token_capacity >= 21


def test_too_many_blocks_is_an_error() -> None:
    batch = _batch(max_model_len=8, block_size=4)
    row = batch.add("a", [1], [1, 2])
    with pytest.raises(ValueError, match="exceed"):
        batch.append_blocks(row, [3])
