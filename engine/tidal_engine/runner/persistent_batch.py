"""The persistent batch: each live request's state in a row of arrays that outlive the step.

A request gets a row when the worker first hears of it and keeps it until it is forgotten
(finished or aborted; a preempted request keeps its row and its history). Per row:

- ``token_ids[row, :num_tokens[row]]``: its known tokens (prompt, then every sampled token
  once it reached the host), host numpy only: the step's ``input_ids`` are gathered from it;
- ``block_table[row, :num_blocks[row]]``: its KV blocks, a host numpy array *mirrored* on
  the device (``block_table_dev``). The host copy computes the slot mapping; the device copy
  is what attention reads (the step gathers its rows with ``batch_rows``). Changes are
  recorded as (flat index, value) pairs and shipped with the step's packed upload, so a
  steady decode step uploads no block table at all, only the entries of requests that
  crossed into a new block;
- ``last_sampled_dev[row]``: the row's last sampled id on the device (async scheduling feeds
  a step's input from it before the host has seen the token).

Row 0 is reserved: all zeros, the row padding sequences read. Capacity (rows and token
columns) grows on demand; the device arrays are reallocated then (rare: the first steps).
"""

from __future__ import annotations

import heapq

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tidal_engine.spec_decode.device_drafts import DeviceDrafts


class PersistentBatch:
    def __init__(
        self,
        max_rows: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        initial_token_capacity: int = 1024,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.capacity = 0  # usable rows (row 0 excluded)
        self.token_capacity = max(16, min(initial_token_capacity, max_model_len + 1))
        w = self.max_blocks_per_seq
        self.token_ids = np.zeros((1, self.token_capacity), dtype=np.int64)
        self.num_tokens = np.zeros(1, dtype=np.int64)
        self.block_table = np.zeros((1, w), dtype=np.int64)
        self.num_blocks = np.zeros(1, dtype=np.int64)
        self.block_table_dev = torch.zeros((1, w), dtype=torch.int64, device=device)
        self.last_sampled_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.row_of: dict[str, int] = {}
        # Async scheduling with speculation: each row's history, drafts and last accepted count
        # on the device (spec_decode/device_drafts.py); None otherwise.
        self.device_drafts: DeviceDrafts | None = None
        self._free: list[int] = []  # a heap: low rows first, so live rows stay packed
        # Block-table changes not yet on the device: flat indices and values, in order.
        self._bt_index: list[np.ndarray] = []
        self._bt_value: list[np.ndarray] = []
        self._grow_rows(max(1, max_rows))

    # ---- capacity --------------------------------------------------------------------
    def _grow_rows(self, need: int) -> None:
        old = self.capacity
        new = max(need, 2 * old)
        extra = new - old
        w = self.max_blocks_per_seq
        self.token_ids = np.concatenate([self.token_ids, np.zeros((extra, self.token_capacity), dtype=np.int64)])
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(extra, dtype=np.int64)])
        self.block_table = np.concatenate([self.block_table, np.zeros((extra, w), dtype=np.int64)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(extra, dtype=np.int64)])
        bt = torch.zeros((new + 1, w), dtype=torch.int64, device=self.device)
        bt[: old + 1].copy_(self.block_table_dev)  # stream-ordered after earlier scatters
        self.block_table_dev = bt
        last = torch.zeros(new + 1, dtype=torch.int64, device=self.device)
        last[: old + 1].copy_(self.last_sampled_dev)
        self.last_sampled_dev = last
        for row in range(old + 1, new + 1):
            heapq.heappush(self._free, row)
        self.capacity = new

    def ensure_token_capacity(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` tokens in every row, plus one column (a fed position is
        read, and overwritten, one past the known tokens)."""
        need = num_tokens + 1
        if need <= self.token_capacity:
            return
        cap = max(need, 2 * self.token_capacity)
        grown = np.zeros((self.token_ids.shape[0], cap), dtype=np.int64)
        grown[:, : self.token_capacity] = self.token_ids
        self.token_ids = grown
        self.token_capacity = cap

    # ---- rows ------------------------------------------------------------------------
    def add(self, req_id: str, token_ids: list[int], block_ids: list[int]) -> int:
        if req_id in self.row_of:
            raise ValueError(f"request {req_id!r} already has a row")
        if not self._free:
            self._grow_rows(self.capacity + 1)
        row = heapq.heappop(self._free)
        self.row_of[req_id] = row
        n = len(token_ids)
        self.ensure_token_capacity(n)
        self.token_ids[row, :n] = token_ids
        if self.device_drafts is not None:
            self.device_drafts.add_row(row, token_ids)
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        self.replace_blocks(row, block_ids)
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_tokens[row] = 0
            self.num_blocks[row] = 0  # stale entries stay: nothing reads past num_blocks
            heapq.heappush(self._free, row)
        return row

    def clear(self) -> None:
        for req_id in list(self.row_of):
            self.remove(req_id)
        self._bt_index.clear()
        self._bt_value.clear()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"row {row}: {end} blocks exceed the {self.max_blocks_per_seq} of max_model_len")
        values = np.asarray(block_ids, dtype=np.int64)
        self.block_table[row, start:end] = values
        self.num_blocks[row] = end
        w = self.max_blocks_per_seq
        self._bt_index.append(np.arange(row * w + start, row * w + end, dtype=np.int64))
        self._bt_value.append(values)

    def replace_blocks(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: list[int] | np.ndarray) -> None:
        """Record one sampled token for each of ``rows`` (distinct rows)."""
        if not len(rows):
            return
        if len(rows) == 1:  # scalar indexing: a verify row's tokens come one call each
            row, count = int(rows[0]), int(self.num_tokens[rows[0]])
            self.ensure_token_capacity(count + 1)
            self.token_ids[row, count] = token_ids[0]
            self.num_tokens[row] = count + 1
            return
        n = self.num_tokens[rows]
        self.ensure_token_capacity(int(n.max()) + 1)
        self.token_ids[rows, n] = token_ids
        self.num_tokens[rows] = n + 1

    def tokens(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.token_ids[row, : self.num_tokens[row]].tolist()

    def blocks(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.block_table[row, : self.num_blocks[row]].tolist()

    # ---- the device mirror -------------------------------------------------------------
    def take_block_updates(self) -> tuple[np.ndarray, np.ndarray]:
        """The block-table entries changed since the last call (flat indices into
        ``block_table_dev`` and their values; each index once, its latest value)."""
        if not self._bt_index:
            return _EMPTY, _EMPTY
        if len(self._bt_index) == 1:
            index, value = self._bt_index[0], self._bt_value[0]
        else:
            index, value = np.concatenate(self._bt_index), np.concatenate(self._bt_value)
        self._bt_index.clear()
        self._bt_value.clear()
        unique, first = np.unique(index[::-1], return_index=True)
        if unique.shape[0] != index.shape[0]:  # an entry written twice (a resume): keep the last
            index, value = unique, value[::-1][first]
        return index, value

    def apply_block_updates(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """On the device: block_table_dev.flat[index] = value (index, value: device views)."""
        if index.numel():
            self.block_table_dev.view(-1).index_copy_(0, index, value)


_EMPTY = np.zeros(0, dtype=np.int64)
