"""A fake KV connector for scheduler tests: both halves over ``test_scheduler.FakeModel``.

The "outside" tier is a dict of block hash → the block's contents (the fake model's KV is the
token ids themselves). The worker half finishes a load ``delay`` polls after it started,
or fails it when ``fail`` says so, without writing anything; saves copy at once, and so do
loads the plan names ``before_forward`` (set ``fuses_loads`` to have the scheduler ask). Everything a
load writes goes through the block ids in the plan, so a wrong block shows up as corrupt KV
in ``FakeModel.execute``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tidal_engine.core.block_pool import BlockHash
from tidal_engine.core.request import Request
from tidal_engine.kv_transfer.base import (
    BlockHolder,
    BlockTransfer,
    KVConnectorScheduler,
    KVTransferPlan,
    KVTransferReport,
)


class FakeConnector(KVConnectorScheduler):
    def __init__(self, holder: BlockHolder, block_size: int) -> None:
        self.holder = holder
        self.block_size = block_size
        self.store: dict[BlockHash, list[int | None]] = {}
        self.addresses: list[BlockHash] = []  # remote address → key
        self._ids = itertools.count(1)
        self._queued: list[tuple[str, BlockTransfer]] = []  # ("load" | "save", transfer)
        self._in_flight: dict[int, tuple[str, str | None, list[int]]] = {}  # id → kind, request, blocks
        self._load_of: dict[str, int] = {}
        self._before_forward: list[int] = []
        self.saving = True

    def _address(self, key: BlockHash) -> int:
        self.addresses.append(key)
        return len(self.addresses) - 1

    def num_matched_tokens(self, request: Request, num_device_hit: int) -> int:
        hashes = request.update_block_hashes(self.block_size, request.num_tokens - 1)
        count = 0
        for key in hashes[num_device_hit // self.block_size:]:
            if key not in self.store:
                break
            count += 1
        return count * self.block_size

    def start_load(self, request: Request, block_ids: list[int], keys: list[BlockHash],
                   before_forward: bool = False) -> None:
        self.holder.hold_blocks(block_ids)
        transfer = BlockTransfer(next(self._ids), list(block_ids), [self._address(k) for k in keys])
        self._queued.append(("load", transfer))
        self._in_flight[transfer.transfer_id] = ("load", request.request_id, list(block_ids))
        self._load_of[request.request_id] = transfer.transfer_id
        if before_forward:
            self._before_forward.append(transfer.transfer_id)

    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        new = [(b, k) for b, k in blocks if k not in self.store] if self.saving else []
        if not new:
            return
        self.holder.hold_blocks([b for b, _ in new])
        transfer = BlockTransfer(next(self._ids), [b for b, _ in new], [self._address(k) for _, k in new])
        self._queued.append(("save", transfer))
        self._in_flight[transfer.transfer_id] = ("save", None, transfer.block_ids)

    def request_finished(self, request: Request) -> None:
        transfer_id = self._load_of.pop(request.request_id, None)
        queued = [t for kind, t in self._queued if t.transfer_id == transfer_id]
        if queued:  # never started: undo now
            self._queued = [(k, t) for k, t in self._queued if t.transfer_id != transfer_id]
            self.holder.release_blocks(self._in_flight.pop(transfer_id)[2])  # type: ignore[arg-type]

    def build_plan(self) -> KVTransferPlan | None:
        if not self._queued:
            return None
        queued, self._queued = self._queued, []
        before, self._before_forward = self._before_forward, []
        return KVTransferPlan(loads=[t for k, t in queued if k == "load"], saves=[t for k, t in queued if k == "save"],
                              before_forward=before)

    def on_report(self, report: KVTransferReport) -> tuple[list[str], list[str]]:
        loaded: list[str] = []
        failed: list[str] = []
        for transfer_id in report.done + report.failed:
            kind, req_id, blocks = self._in_flight.pop(transfer_id)
            self.holder.release_blocks(blocks)
            if kind == "load" and req_id is not None and self._load_of.get(req_id) == transfer_id:
                del self._load_of[req_id]
                (loaded if transfer_id in report.done else failed).append(req_id)
        return loaded, failed

    def has_pending(self) -> bool:
        return bool(self._in_flight)


class FakeConnectorWorker:
    """The worker half over a fake model's KV (``kv[block][offset]``)."""

    def __init__(self, connector: FakeConnector, kv: list[list[int | None]], delay: int = 0,
                 fail: Callable[[BlockTransfer], bool] = lambda t: False) -> None:
        self.connector = connector
        self.kv = kv
        self.delay = delay
        self.fail = fail
        self._loads: list[tuple[int, BlockTransfer]] = []  # (polls left, transfer)
        self._done: list[int] = []
        self.started_loads = 0

    def start(self, plan: KVTransferPlan) -> None:
        for t in plan.saves:
            for block, address in zip(t.block_ids, t.remote):
                self.connector.store[self.connector.addresses[address]] = list(self.kv[block])
            self._done.append(t.transfer_id)
        for t in plan.loads:
            self.started_loads += 1
            if t.transfer_id in plan.before_forward:  # the forward of this step reads it
                self._write(t)
                self._done.append(t.transfer_id)
            else:
                self._loads.append((self.delay, t))

    def _write(self, t: BlockTransfer) -> None:
        for block, address in zip(t.block_ids, t.remote):
            self.kv[block] = list(self.connector.store[self.connector.addresses[address]])

    def poll(self) -> KVTransferReport:
        done, failed = self._done, []
        self._done = []
        waiting: list[tuple[int, BlockTransfer]] = []
        for left, t in self._loads:
            if left > 0:
                waiting.append((left - 1, t))
            elif self.fail(t):
                failed.append(t.transfer_id)
            else:
                self._write(t)
                done.append(t.transfer_id)
        self._loads = waiting
        return KVTransferReport(done=done, failed=failed)
