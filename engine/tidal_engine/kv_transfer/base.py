"""The KV connector interface: how KV blocks move between the device cache and somewhere else.

A connector has two halves, as vLLM's ``KVConnectorBase_V1`` has (this is our own shape):

- **scheduler side** (``KVConnectorScheduler``, in the engine core, pure Python): it says how
  many tokens of a request beyond the device prefix-cache hit can be *loaded* from outside,
  learns which device blocks were allocated for them, decides which computed blocks to *save*,
  and turns both into a ``KVTransferPlan`` carried by the step's ``StepPlan``. Reports of
  finished transfers come back with the step's result.
- **worker side** (``KVConnectorWorker``, next to the model runner): it starts the plan's
  loads and saves without waiting (CUDA streams on GPU, so they overlap the forward) and
  reports which transfers finished or failed.

Device blocks a transfer reads or writes are held (an extra reference in the block pool) by
the scheduler side until the worker reports the transfer, so an abort, a preemption or an
eviction can never hand such a block to another request mid-copy.

A request whose KV is being loaded waits in the scheduler's ``WAITING_FOR_REMOTE_KV`` state:
it holds its blocks but is not scheduled; when its load is reported it runs from the loaded
position, and when the load fails it recomputes from its device hit (nothing is lost).
Prefill/decode disaggregation only needs another connector: its ``remote`` addresses name a
peer's blocks instead of host slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from tidal_engine.core.block_pool import BlockHash
    from tidal_engine.core.request import Request


class BlockTransfer(msgspec.Struct, frozen=True, array_like=True):
    """Copy ``block_ids[i]`` (device) to or from ``remote[i]`` (the connector's own address:
    a host slot for offload, a peer's block for disaggregation)."""

    transfer_id: int
    block_ids: list[int]
    remote: list[int]


class KVTransferPlan(msgspec.Struct, frozen=True):
    """A step's transfers: loads (remote → device) and saves (device → remote).

    ``before_forward``: ids of transfers the step's forward must wait for on the device (a
    load whose request computes its tail in this same step; a save of a block this step
    overwrites). The others overlap the forward and later steps."""

    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    before_forward: list[int] = []

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


class KVTransferReport(msgspec.Struct, frozen=True):
    """What a worker finished since its last report (transfer ids), with what it moved."""

    done: list[int] = []
    failed: list[int] = []
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not self.done and not self.failed


class BlockHolder(Protocol):
    """What the scheduler side may do to device blocks (the ``KVCacheManager`` does this):
    keep them out of reuse while they are copied, and hear when cached ones are reused."""

    def hold_blocks(self, block_ids: list[int]) -> None: ...

    def release_blocks(self, block_ids: list[int]) -> None: ...

    def watch_evictions(self, callback: Callable[[int, BlockHash], None]) -> None: ...


class KVConnectorScheduler(ABC):
    """The engine core's half. Every method runs in the engine loop thread."""

    #: The worker orders a load before the forward of its step when asked (``before_forward``),
    #: and a load, once issued, never fails. Then a request whose load starts in a step with
    #: no other work computes its tail in that same step instead of the next one (no
    #: transfer-only step on the TTFT path). A connector whose loads can fail keeps this False.
    fuses_loads: bool = False

    @abstractmethod
    def num_matched_tokens(self, request: Request, num_device_hit: int) -> int:
        """Tokens after the first ``num_device_hit`` that this connector can load (a multiple
        of the block size). The scheduler caps the answer so one token is always computed.
        What matched must stay loadable until ``start_load`` or ``match_dropped``: allocating
        the device blocks for it can evict device blocks, and their saves must not push out
        the very blocks about to be loaded."""

    def match_dropped(self, request: Request) -> None:  # noqa: B027 - nothing held by default
        """The scheduler will not load what ``num_matched_tokens`` just matched (no room, or
        nothing left after its cap): release whatever the match holds."""

    @abstractmethod
    def start_load(self, request: Request, block_ids: list[int], keys: list[BlockHash],
                   before_forward: bool = False) -> None:
        """Load ``keys`` into the freshly allocated device ``block_ids`` for ``request``;
        ``before_forward``: the request computes in the same step (only if ``fuses_loads``)."""

    @abstractmethod
    def blocks_computed(self, request: Request, blocks: list[tuple[int, BlockHash]]) -> None:
        """These full blocks of ``request`` were just computed: save them if wanted."""

    @abstractmethod
    def request_finished(self, request: Request) -> None:
        """The request ended (finished, aborted); drop what it queued and not yet issued."""

    @abstractmethod
    def build_plan(self) -> KVTransferPlan | None:
        """The transfers to start with the next step (None: nothing new)."""

    @abstractmethod
    def on_report(self, report: KVTransferReport) -> tuple[list[str], list[str]]:
        """Apply a worker's report; returns the request ids whose loads (done, failed) ended."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Transfers queued or in flight: the core keeps stepping to collect their reports."""

    def reset(self) -> bool:
        """Forget what the connector stores (the admin reset of the prefix cache)."""
        return True

    def stats(self) -> dict[str, float]:
        """Cumulative counters for ``CoreStats`` (names as in ``OffloadStats``)."""
        return {}


class KVConnectorWorker(ABC):
    """A worker's half: owns whatever the remote side needs (a pinned host pool, a link)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The device cache, one tensor per layer shaped ``[2, num_blocks, ...]``."""

    @abstractmethod
    def start(self, plan: KVTransferPlan) -> None:
        """Start the plan's transfers, ordered after the device work already queued; never
        wait for them. Called before the step's forward is queued."""

    @abstractmethod
    def poll(self, wait: bool = False) -> KVTransferReport:
        """Transfers finished since the last poll; ``wait``: block until one finishes (a step
        without a forward has nothing else to do)."""

    def wait_all(self) -> None:  # noqa: B027 - a synchronous connector has nothing to wait for
        """Block until every started transfer finished (before the device cache goes away)."""

    def info(self) -> dict[str, Any]:
        """What the scheduler side needs to know (e.g. the host pool's size), once at start."""
        return {}
