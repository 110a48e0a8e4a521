"""The host tier's bookkeeping: which block hash sits in which host slot, LRU. Pure Python.

The slots' bytes live on the worker (``offload_worker.py``); this map lives in the engine
core and decides everything: lookups, which slot a save writes, which entry is evicted.

- An entry is *ready* once its save was reported; only ready entries hit.
- A ready entry being loaded is *pinned* (a count) and cannot be evicted.
- A save *reserves* a slot first (evicting the least recently used unpinned entry when no
  slot is free); the reservation becomes an entry on ``commit`` and is dropped on ``abort``.
Keys are the device tier's chained block hashes (salt and LoRA generation included), so
isolation between tenants and adapters holds in this tier too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tidal_engine.core.block_pool import BlockHash


class HostBlockPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._ready: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._reserved: dict[BlockHash, int] = {}
        self._pins: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.num_evictions = 0

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def contains(self, key: BlockHash) -> bool:
        return key in self._ready or key in self._reserved

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, are ready here (keys chain: stop at a miss)."""
        count = 0
        for key in keys:
            if key not in self._ready:
                break
            count += 1
        return count

    def pin(self, keys: Sequence[BlockHash]) -> list[int]:
        """Slots of ready ``keys`` (now most recently used), pinned until ``unpin``."""
        slots: list[int] = []
        for key in keys:
            slot = self._ready[key]
            self._ready.move_to_end(key)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            count = self._pins[slot] - 1
            if count:
                self._pins[slot] = count
            else:
                del self._pins[slot]

    def reserve(self, key: BlockHash) -> int | None:
        """A slot for saving ``key`` (None: already here, or every slot is pinned or reserved)."""
        if self.contains(key):
            return None
        if not self._free and not self._evict_one():
            return None
        slot = self._free.pop()
        self._reserved[key] = slot
        return slot

    def commit(self, key: BlockHash) -> None:
        slot = self._reserved.pop(key)
        self._ready[key] = slot

    def abort(self, key: BlockHash) -> None:
        self._free.append(self._reserved.pop(key))

    def clear(self) -> None:
        """Forget every ready entry that no load is reading (resets happen with no requests in
        flight, so in practice everything)."""
        for key, slot in list(self._ready.items()):
            if slot not in self._pins:
                del self._ready[key]
                self._free.append(slot)

    def _evict_one(self) -> bool:
        for key, slot in self._ready.items():  # oldest first
            if slot not in self._pins:
                del self._ready[key]
                self._free.append(slot)
                self.num_evictions += 1
                return True
        return False
