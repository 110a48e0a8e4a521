"""The adapter manager: which adapters exist, which are in host memory, which sit in device slots.

Three tiers, as in vLLM:

- **registered**: a name and a validated path. Unbounded; this is what ``/v1/models`` lists.
- **host cache** (``--max-cpu-loras``): the converted tensors, LRU. An adapter evicted from
  it is re-read from its path when a request needs it again. Adapters with requests in
  flight are pinned, so a step never has to touch the disk.
- **device slots** (``--max-loras``): what a forward pass can use. The scheduler admits at
  most ``max_loras`` distinct adapters into the running batch, so every step fits; slots
  are reassigned least-recently-used first.

Unloading an adapter that requests still use marks it *unloading*: new requests for it are
refused at once (404), the running ones finish, and the last one out removes it.

Everything except ``read_adapter`` (pure, any thread) and the ``list_*`` readers runs in
the engine loop thread; the registry is guarded by a lock so the HTTP side can read it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tidal_engine.lora.adapter import BaseModelShape, LoRAAdapter, LoRAError, read_adapter
from tidal_engine.lora.layers import LoRABatch, LoRAModelSlots

logger = logging.getLogger(__name__)


@dataclass
class LoRASettings:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    allowed_roots: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Any) -> LoRASettings:
        """The settings an EngineConfig asks for."""
        return cls(max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                   max_cpu_loras=config.max_cpu_loras, allowed_roots=tuple(config.allowed_lora_roots or ()))

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass
class AdapterInfo:
    """What the server shows about a registered adapter."""

    name: str
    path: str
    rank: int
    unloading: bool


@dataclass
class _Entry:
    name: str
    path: str
    rank: int
    host: LoRAAdapter | None
    refs: int = 0  # unfinished user requests that use it
    unloading: bool = False
    generation: int = 0  # which load of this name (the prefix-cache key includes it)


class LoRAManager:
    def __init__(self, shape: BaseModelShape, settings: LoRASettings, slots: LoRAModelSlots | None) -> None:
        self.shape = shape
        self.settings = settings
        self.slots = slots
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._host_lru: OrderedDict[str, None] = OrderedDict()  # names with host copies, oldest first
        self._slot_names: list[str | None] = [None] * settings.max_loras
        self._slot_used_at: list[int] = [-1] * settings.max_loras
        self._step = 0
        self._loads = itertools.count(1)

    # ---- registry ----------------------------------------------------------------------
    def read_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Read and validate an adapter folder without registering it (safe in any thread)."""
        self._check_new_name(name)
        return read_adapter(name, path, self.shape, max_rank=self.settings.max_lora_rank,
                            allowed_roots=self.settings.allowed_roots)

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip():
            raise LoRAError("lora_name must be a non-empty string")
        entry = self._entries.get(name)
        if entry is not None and entry.unloading:
            raise LoRAError(f"The lora adapter '{name}' is being unloaded; load it again once its "
                            "running requests have finished.")
        if entry is not None:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter read by ``read_adapter``."""
        with self._lock:
            self._check_new_name(adapter.name)
            self._entries[adapter.name] = _Entry(adapter.name, adapter.path, adapter.rank, adapter,
                                                 generation=next(self._loads))
            self._touch_host(adapter.name)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %.1f MiB)",
                    adapter.name, adapter.path, adapter.rank, adapter.num_bytes / 2**20)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and register in one go (start-up ``--lora-modules``, tests)."""
        adapter = self.read_adapter(name, path)
        self.add(adapter)
        return adapter

    def remove(self, name: str) -> bool:
        """Unload ``name``. Returns True when it is gone now, False when it waits for its
        running requests (it is refused to new ones from now on). Unknown name: 404."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise LoRAError(f"The lora adapter '{name}' cannot be found.", status=404)
            if entry.refs > 0:
                entry.unloading = True
                logger.info("LoRA adapter %s: unloading once its %d request(s) finish", name, entry.refs)
                return False
            self._drop(name)
            return True

    def _drop(self, name: str) -> None:
        self._entries.pop(name, None)
        self._host_lru.pop(name, None)
        for slot, holder in enumerate(self._slot_names):
            if holder == name:
                self._slot_names[slot] = None
                self._slot_used_at[slot] = -1
        logger.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> AdapterInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else AdapterInfo(entry.name, entry.path, entry.rank, entry.unloading)

    def list_adapters(self, include_unloading: bool = False) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(e.name, e.path, e.rank, e.unloading) for e in self._entries.values()
                    if include_unloading or not e.unloading]

    def cache_key(self, name: str) -> str:
        """The adapter's identity in KV cache keys: its name plus which load this is, so KV
        computed with an adapter that was unloaded and loaded again (other weights, same
        name) never hits, in any tier."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise LoRAError(f"The model `{name}` does not exist.", status=404)
            return f"{name}#{entry.generation}"

    def is_servable(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and not entry.unloading

    # ---- requests ----------------------------------------------------------------------
    def acquire(self, name: str) -> None:
        """A new request uses ``name``: make sure it is servable and its tensors are in host
        memory (re-read from disk if the host cache evicted them)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise LoRAError(f"The model `{name}` does not exist.", status=404)
            entry.refs += 1  # first, so the host cache keeps the copy pinned
            try:
                self._host_copy(entry)
            except LoRAError:
                entry.refs -= 1
                raise

    def _host_copy(self, entry: _Entry) -> LoRAAdapter:
        host = entry.host
        if host is None:
            host = read_adapter(entry.name, entry.path, self.shape, max_rank=self.settings.max_lora_rank,
                                allowed_roots=self.settings.allowed_roots)
            entry.host = host
        self._touch_host(entry.name)  # may evict it again at once if the cache is full of pinned ones
        return host

    def release(self, name: str) -> None:
        """A request that used ``name`` finished or was aborted."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.refs = max(0, entry.refs - 1)
            if entry.refs == 0 and entry.unloading:
                self._drop(name)
            else:
                self._trim_host_cache()

    def _touch_host(self, name: str) -> None:
        self._host_lru.pop(name, None)
        self._host_lru[name] = None
        self._trim_host_cache()

    def _trim_host_cache(self) -> None:
        # Evict the oldest host copies beyond the limit, except those with requests in flight.
        excess = len(self._host_lru) - self.settings.host_cache_size
        for name in list(self._host_lru):
            if excess <= 0:
                break
            entry = self._entries.get(name)
            if entry is not None and entry.refs > 0:
                continue
            self._host_lru.pop(name)
            if entry is not None:
                entry.host = None
            excess -= 1

    # ---- steps -------------------------------------------------------------------------
    def begin_step(self, chunks: Sequence[Any]) -> bool:
        """Map this step's rows to slots (loading adapters into free or LRU slots) and arm the
        hooks. ``chunks``: the scheduler's chunks in batch order (``.request.lora_name``,
        ``.num_new_tokens``). Returns False, with the hooks off, when no row uses an adapter."""
        assert self.slots is not None, "a registry without device slots (the engine core's) runs no steps"
        names = {c.request.lora_name for c in chunks if c.request.lora_name is not None}
        if not names:
            self.slots.context.batch = None
            return False
        self._step += 1
        slot_of = {name: self._slot_for(name, names) for name in names}
        runs = [(slot_of[c.request.lora_name] if c.request.lora_name is not None else -1, c.num_new_tokens)
                for c in chunks]
        self.slots.context.batch = LoRABatch.build(runs, model_slots_device(self.slots))
        return self.slots.context.batch is not None

    def end_step(self) -> None:
        if self.slots is not None:
            self.slots.context.batch = None

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self._slot_names:
            slot = self._slot_names.index(name)
        else:
            free = [s for s, holder in enumerate(self._slot_names) if holder is None or holder not in needed]
            if not free:
                raise RuntimeError(
                    f"more adapters in one step than --max-loras ({self.settings.max_loras}); the scheduler "
                    "should have prevented this"
                )
            slot = min(free, key=lambda s: (self._slot_names[s] is not None, self._slot_used_at[s]))
            with self._lock:
                # Requests in flight pin their adapter's host copy; this reads the disk only
                # for callers that skip acquire() (tests, the offline API's direct use).
                self.slots.write_slot(slot, self._host_copy(self._entries[name]))
            self._slot_names[slot] = name
        self._slot_used_at[slot] = self._step
        return slot

    def reattach(self, model: torch.nn.Module) -> None:
        """The model was rebuilt (wake from sleep level 2): hook it, with new, empty slots
        (they refill from the host cache, or the disk, as steps need them)."""
        if self.slots is not None:
            self.slots.detach()
        self.slots = LoRAModelSlots(model, self.settings.max_loras, self.settings.max_lora_rank)
        self._slot_names = [None] * self.settings.max_loras
        self._slot_used_at = [-1] * self.settings.max_loras

    # ---- introspection (tests, metrics) --------------------------------------------------
    def slot_table(self) -> list[str | None]:
        return list(self._slot_names)

    def host_cached(self) -> list[str]:
        with self._lock:
            return list(self._host_lru)

    def refs(self, name: str) -> int:
        with self._lock:
            entry = self._entries.get(name)
            return 0 if entry is None else entry.refs


def create_lora_manager(model: torch.nn.Module, arch: Any, config: Any) -> LoRAManager | None:
    """The manager for an EngineConfig (None when LoRA is off): slots and hooks on ``model``."""
    if not getattr(config, "enable_lora", False):
        return None
    settings = LoRASettings.from_config(config)
    slots = LoRAModelSlots(model, settings.max_loras, settings.max_lora_rank)
    logger.info("LoRA enabled: %d slot(s) of rank %d, %.1f MiB of device memory",
                settings.max_loras, settings.max_lora_rank, slots.num_bytes() / 2**20)
    return LoRAManager(BaseModelShape.from_arch(arch), settings, slots)


def create_lora_registry(arch: Any, config: Any) -> LoRAManager | None:
    """The engine core's adapter registry when the workers are other processes (None when LoRA
    is off): names, paths, references and host copies, no device slots. Each worker keeps its
    own manager with slots, which the core's add/remove reach through the executor."""
    if not getattr(config, "enable_lora", False):
        return None
    settings = LoRASettings.from_config(config)
    return LoRAManager(BaseModelShape.from_arch(arch), settings, None)


def model_slots_device(slots: LoRAModelSlots) -> torch.device:
    return next(iter(slots.modules.values())).a.device
