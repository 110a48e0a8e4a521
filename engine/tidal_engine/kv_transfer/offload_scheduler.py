"""The host-memory offload connector, scheduler side: the host tier's map and its transfers.

Saving policy (``save_policy``, flag ``--kv-offloading-save``):

- ``write-through`` (the default): each full block is queued for saving to host memory the
  step after it is computed (unless the host tier has it already). The copy runs on a side
  stream while later steps compute, and a block is copied once however often it is evicted
  and reloaded; the cost is host bandwidth for blocks that are never evicted.
- ``eviction``: a cached block is saved when the device pool evicts it for reuse. Nothing
  is copied for blocks that are never evicted, but the copy sits on the critical path: the
  forward of the step that reuses the block waits for it (``before_forward``), and a block
  reloaded and evicted again is copied again only if the host tier dropped it meanwhile.
docs/kv-offload.md gives the measured comparison.

Each request's load is one transfer; each step's saves are one transfer (two under
``eviction``: the evicted blocks, which the forward waits for). Device blocks a transfer
reads are held until its report (an evicted block is not: its new owner's forward waits
for the copy instead); host slots are pinned (loads) or reserved (saves).

A load whose request computes its tail in the same step (``fuses_loads``) is flagged
``before_forward``: the worker orders the forward after it on the device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tidal_engine.core.block_pool import BlockHash
from tidal_engine.core.request import Request
from tidal_engine.kv_transfer.base import (
    BlockHolder,
    BlockTransfer,
    KVConnectorScheduler,
    KVTransferPlan,
    KVTransferReport,
)
from tidal_engine.kv_transfer.host_pool import HostBlockPool


@dataclass
class OffloadStats:
    """Cumulative; bytes and seconds as the worker reported them."""

    blocks_loaded: int = 0
    blocks_saved: int = 0
    failed_loads: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0


SAVE_POLICIES = ("write-through", "eviction")


@dataclass
class _Load:
    req_id: str
    block_ids: list[int]
    slots: list[int]
    issued: bool = False
    before_forward: bool = False


@dataclass
class _Save:
    keys: list[BlockHash] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class OffloadConnectorScheduler(KVConnectorScheduler):
    fuses_loads = True  # the worker orders flagged loads before the forward; copies never fail

    def __init__(self, holder: BlockHolder, block_size: int, num_host_blocks: int,
                 save_policy: str = "write-through") -> None:
        if save_policy not in SAVE_POLICIES:
            raise ValueError(f"save_policy must be one of {SAVE_POLICIES}, got {save_policy!r}")
        self.save_policy = save_policy
        self.holder = holder
        self.block_size = block_size
        self.pool = HostBlockPool(num_host_blocks)
        self.offload_stats = OffloadStats()
        self._ids = itertools.count(1)
        self._loads: dict[int, _Load] = {}  # transfer id → load (queued or in flight)
        self._load_of: dict[str, int] = {}  # request id → its load's transfer id
        self._matched: dict[str, list[int]] = {}  # request id → host slots its lookup pinned
        self._queued_save = _Save()
        self._queued_evicted = _Save()  # under "eviction": blocks this step's forward overwrites
        self._saves: dict[int, _Save] = {}  # in flight (blocks held, unless evicted)
        self._evicted_saves: set[int] = set()  # transfer ids of evicted-block saves
        holder.watch_evictions(self.block_evicted)  # a no-op under write-through

    # ---- lookups and loads ---------------------------------------------------------------
    def num_matched_tokens(self, request: Request, num_device_hit: int) -> int:
        self.match_dropped(request)
        hashes = request.update_block_hashes(self.block_size, request.num_tokens - 1)
        start = num_device_hit // self.block_size
        count = self.pool.lookup(hashes[start:])
        if count:  # pinned until start_load: saves of blocks the allocation evicts can't drop them
            self._matched[request.request_id] = self.pool.pin(hashes[start:start + count])
        return count * self.block_size

    def match_dropped(self, request: Request) -> None:
        slots = self._matched.pop(request.request_id, None)
        if slots:
            self.pool.unpin(slots)

    def start_load(self, request: Request, block_ids: list[int], keys: list[BlockHash],
                   before_forward: bool = False) -> None:
        slots = self.pool.pin(keys)  # a prefix of what matched, so still ready
        self.match_dropped(request)
        self.holder.hold_blocks(block_ids)
        transfer_id = next(self._ids)
        self._loads[transfer_id] = _Load(request.request_id, list(block_ids), slots, before_forward=before_forward)
        self._load_of[request.request_id] = transfer_id

    # ---- saves ---------------------------------------------------------------------------
    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        if self.save_policy != "write-through":
            return
        save = self._queued_save
        for block_id, key in blocks:
            if self._queue(save, block_id, key):
                self.holder.hold_blocks([block_id])

    def block_evicted(self, block_id: int, key: BlockHash) -> None:
        """The device pool is handing cached ``block_id`` to a new owner (``BlockPool.on_evict``)."""
        if self.save_policy == "eviction":
            self._queue(self._queued_evicted, block_id, key)

    def _queue(self, save: _Save, block_id: int, key: BlockHash) -> bool:
        slot = self.pool.reserve(key)
        if slot is None:
            return False  # already in host memory (or being saved), or the pool is all pinned
        save.keys.append(key)
        save.block_ids.append(block_id)
        save.slots.append(slot)
        return True

    # ---- the step's plan and its report --------------------------------------------------
    def request_finished(self, request: Request) -> None:
        transfer_id = self._load_of.pop(request.request_id, None)
        if transfer_id is None:
            return
        load = self._loads[transfer_id]
        if not load.issued:  # no worker touched it: undo now
            del self._loads[transfer_id]
            self._end_load(load)
        # An issued load keeps its blocks held until the worker reports it.

    def build_plan(self) -> KVTransferPlan | None:
        loads = [BlockTransfer(tid, load.block_ids, load.slots)
                 for tid, load in self._loads.items() if not load.issued]
        for transfer in loads:
            self._loads[transfer.transfer_id].issued = True
        before = [t.transfer_id for t in loads if self._loads[t.transfer_id].before_forward]
        saves: list[BlockTransfer] = []
        if self._queued_evicted.keys:  # first: a load may write a block this copy reads
            transfer_id = next(self._ids)
            save, self._queued_evicted = self._queued_evicted, _Save()
            self._saves[transfer_id] = save
            self._evicted_saves.add(transfer_id)
            saves.append(BlockTransfer(transfer_id, save.block_ids, save.slots))
            before.append(transfer_id)
        if self._queued_save.keys:
            transfer_id = next(self._ids)
            save, self._queued_save = self._queued_save, _Save()
            self._saves[transfer_id] = save
            saves.append(BlockTransfer(transfer_id, save.block_ids, save.slots))
        if not loads and not saves:
            return None
        return KVTransferPlan(loads=loads, saves=saves, before_forward=before)

    def on_report(self, report: KVTransferReport) -> tuple[list[str], list[str]]:
        stats = self.offload_stats
        stats.bytes_loaded += report.bytes_loaded
        stats.bytes_saved += report.bytes_saved
        stats.load_seconds += report.load_seconds
        stats.save_seconds += report.save_seconds
        loaded: list[str] = []
        failed: list[str] = []
        for transfer_id, ok in [(t, True) for t in report.done] + [(t, False) for t in report.failed]:
            save = self._saves.pop(transfer_id, None)
            if save is not None:
                for key in save.keys:
                    self.pool.commit(key) if ok else self.pool.abort(key)
                if transfer_id in self._evicted_saves:
                    self._evicted_saves.discard(transfer_id)  # never held: the forward waited for it
                else:
                    self.holder.release_blocks(save.block_ids)
                if ok:
                    stats.blocks_saved += len(save.keys)
                continue
            load = self._loads.pop(transfer_id, None)
            if load is None:
                continue
            self._end_load(load)
            if self._load_of.get(load.req_id) == transfer_id:  # still alive (not aborted)
                del self._load_of[load.req_id]
                (loaded if ok else failed).append(load.req_id)
            if ok:
                stats.blocks_loaded += len(load.block_ids)
            else:
                stats.failed_loads += 1
        return loaded, failed

    def has_pending(self) -> bool:
        return bool(self._loads or self._saves or self._queued_save.keys or self._queued_evicted.keys)

    def reset(self) -> bool:
        self.pool.clear()
        return True

    def stats(self) -> dict[str, float]:
        s = self.offload_stats
        return {
            "kv_offload_bytes_loaded": s.bytes_loaded,
            "kv_offload_bytes_saved": s.bytes_saved,
            "kv_offload_load_seconds": s.load_seconds,
            "kv_offload_save_seconds": s.save_seconds,
            "kv_offload_failed_loads": s.failed_loads,
            "kv_offload_host_usage": self.pool.usage,
        }

    def _end_load(self, load: _Load) -> None:
        self.pool.unpin(load.slots)
        self.holder.release_blocks(load.block_ids)
