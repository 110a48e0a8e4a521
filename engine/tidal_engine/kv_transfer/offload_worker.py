"""The host-memory offload connector, worker side: the host pool's bytes and the copies.

The host pool is one tensor ``[num_slots, num_layers, 2, block_bytes/2]`` of bytes (pinned on
CUDA), so a slot holds one block of every layer contiguously: a block moves in one copy
however many layers the model has, and a run of consecutive slots in one copy too. On the
device, the block's layers are gathered into (saves) or scattered from (loads) a staging
buffer with one indexed copy per layer. The byte view makes the pool independent of the
KV dtype.

On CUDA, loads run on one side stream and saves on another, each first waiting for the
device work already queued (the forward that computed a saved block; the forward that last
used a block a load overwrites), and each transfer ends with an event polled at step ends,
so copies overlap the forwards of later steps. Transfers the plan names ``before_forward``
(a load fused with its request's tail, a save of an evicted block) make the compute stream
wait for their event, so the step's forward runs after them. On CPU everything is synchronous (the CPU
backend's "device" cache and the host pool are separate tensors, so the tier logic is the same).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from tidal_engine.kv_transfer.base import BlockTransfer, KVConnectorWorker, KVTransferPlan, KVTransferReport

logger = logging.getLogger(__name__)

STAGING_BYTES = 128 << 20  # per direction: bounds the device memory the copies borrow


@dataclass
class _InFlight:
    transfer_id: int
    is_load: bool
    num_bytes: int
    done: Any  # torch.cuda.Event, or None (finished synchronously)
    start: Any  # timing start event, or the elapsed seconds already measured (float)


def bytes_per_block(kv_caches: list[torch.Tensor]) -> int:
    return sum(t[:, 0].numel() * t.element_size() for t in kv_caches)


def host_pool_blocks(size_gib: float, kv_caches: list[torch.Tensor]) -> int:
    return int(size_gib * 2**30) // bytes_per_block(kv_caches)


class OffloadConnectorWorker(KVConnectorWorker):
    def __init__(self, size_gib: float, kv_caches: list[torch.Tensor], device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.register_kv_caches(kv_caches)
        self.num_slots = host_pool_blocks(size_gib, kv_caches)
        if self.num_slots < 1:
            raise ValueError(f"--kv-offloading-size {size_gib} GiB is smaller than one KV block "
                             f"({bytes_per_block(kv_caches)} bytes)")
        started = time.perf_counter()
        self.host = _host_pool((self.num_slots, len(self._layers), 2, self._half_bytes), self.is_cuda)
        logger.info("KV offload: %d host blocks (%.2f GiB%s) in %.1f s", self.num_slots, self.host.numel() / 2**30,
                    ", pinned" if self.host.is_pinned() else "", time.perf_counter() - started)
        chunk = max(1, STAGING_BYTES // self._block_bytes)
        self.chunk_blocks = chunk
        self._stage_load = torch.empty((chunk, len(self._layers), 2, self._half_bytes), dtype=torch.uint8, device=device)
        self._stage_save = torch.empty_like(self._stage_load)
        self._load_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._save_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._in_flight: deque[_InFlight] = deque()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        # [2, num_blocks, ...] → bytes [2, num_blocks, half]: one row per block and K/V half.
        self._layers = [t.view(torch.uint8).reshape(2, t.shape[1], -1) for t in kv_caches]
        self._half_bytes = int(self._layers[0].shape[2]) if self._layers else 0
        self._block_bytes = 2 * self._half_bytes * len(self._layers)

    def info(self) -> dict[str, Any]:
        return {"num_host_blocks": self.num_slots, "bytes_per_block": self._block_bytes,
                "pinned": bool(self.host.is_pinned())}

    # ---- starting transfers ----------------------------------------------------------------
    def start(self, plan: KVTransferPlan) -> None:
        first = len(self._in_flight)
        if plan.saves:
            self._run(plan.saves, is_load=False)
        if plan.loads:
            # An evicted block's save reads what a load may now write: loads queue after saves.
            self._run(plan.loads, is_load=True, after_saves=bool(plan.before_forward) and bool(plan.saves))
        if plan.before_forward and self.is_cuda:  # the forward queued next waits for these on the device
            wanted = set(plan.before_forward)
            compute = torch.cuda.current_stream(self.device)
            for item in list(self._in_flight)[first:]:
                if item.transfer_id in wanted:
                    compute.wait_event(item.done)

    def _run(self, transfers: list[BlockTransfer], is_load: bool, after_saves: bool = False) -> None:
        stream = self._load_stream if is_load else self._save_stream
        if stream is None:
            for t in transfers:
                began = time.perf_counter()
                self._copy(t, is_load)
                self._in_flight.append(_InFlight(t.transfer_id, is_load, len(t.block_ids) * self._block_bytes,
                                                 None, time.perf_counter() - began))
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the device work queued so far
        if after_saves and self._save_stream is not None:
            stream.wait_stream(self._save_stream)
        with torch.cuda.stream(stream):
            for t in transfers:
                start = torch.cuda.Event(enable_timing=True)
                done = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                self._copy(t, is_load)
                done.record(stream)
                self._in_flight.append(_InFlight(t.transfer_id, is_load, len(t.block_ids) * self._block_bytes,
                                                 done, start))

    def _copy(self, t: BlockTransfer, is_load: bool) -> None:
        stage = self._stage_load if is_load else self._stage_save
        for a in range(0, len(t.block_ids), self.chunk_blocks):
            blocks = t.block_ids[a : a + self.chunk_blocks]
            slots = t.remote[a : a + self.chunk_blocks]
            n = len(blocks)
            index = torch.tensor(blocks, dtype=torch.long)
            if self.is_cuda:  # pinned, so the upload is asynchronous and the host never waits for the stream
                index = index.pin_memory()
            index = index.to(self.device, non_blocking=True)
            if is_load:
                for lo, hi, s0 in _runs(slots):  # host slots → staging, one copy per run
                    stage[lo:hi].copy_(self.host[s0 : s0 + hi - lo], non_blocking=True)
                for layer, cache in enumerate(self._layers):
                    cache.index_copy_(1, index, stage[:n, layer].transpose(0, 1))
            else:
                for layer, cache in enumerate(self._layers):
                    stage[:n, layer].copy_(cache.index_select(1, index).transpose(0, 1))
                for lo, hi, s0 in _runs(slots):
                    self.host[s0 : s0 + hi - lo].copy_(stage[lo:hi], non_blocking=True)

    # ---- completions -----------------------------------------------------------------------
    def poll(self, wait: bool = False) -> KVTransferReport:
        done: list[int] = []
        sizes = {True: 0, False: 0}
        seconds = {True: 0.0, False: 0.0}
        if wait and self._in_flight and self._in_flight[0].done is not None:
            self._in_flight[0].done.synchronize()
        remaining: deque[_InFlight] = deque()
        for item in self._in_flight:  # load and save streams finish independently: check each
            if item.done is not None and not item.done.query():
                remaining.append(item)
                continue
            done.append(item.transfer_id)
            sizes[item.is_load] += item.num_bytes
            seconds[item.is_load] += item.start if item.done is None else item.start.elapsed_time(item.done) / 1e3
        self._in_flight = remaining
        return KVTransferReport(done=done, bytes_loaded=sizes[True], bytes_saved=sizes[False],
                                load_seconds=seconds[True], save_seconds=seconds[False])

    def wait_all(self) -> None:
        for item in self._in_flight:
            if item.done is not None:
                item.done.synchronize()

    def close(self) -> None:
        self.wait_all()


def _host_pool(shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    """The pool's bytes. On CUDA they are page-locked with cudaHostRegister, so the pool takes
    exactly its size (torch's pinned allocator would round it up to a power of two, past the
    Pod's memory limit); if registering fails, that allocator is the fallback."""
    pool = torch.empty(shape, dtype=torch.uint8)
    if not pin:
        return pool
    try:
        err = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
        if int(getattr(err, "value", err)) == 0 and pool.is_pinned():
            return pool
        logger.warning("cudaHostRegister of the KV host pool failed (%s); using torch's pinned allocator", err)
    except Exception as exc:  # noqa: BLE001 - any failure: the fallback below
        logger.warning("cudaHostRegister unavailable (%s); using torch's pinned allocator", exc)
    del pool
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: (first index, end index, first slot)."""
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((lo, i, slots[lo]))
            lo = i
    return runs
