"""Host → GPU copies of checkpoint bytes through page-locked staging, several at once.

A ``tensor.to("cuda")`` of pageable memory (a safetensors memory map) is staged by the driver
and serialised on the device's default stream: about 7 GB/s on the H200 machine. Here each
loading thread copies its slice of the map into its own pair of page-locked chunks (numpy,
without the GIL) and sends each chunk on its own stream while it fills the other, so the
threads' reads and the copies to the device overlap.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tidal_engine.runner.host_buffer import HostBuffer

CHUNK_BYTES = 32 << 20


class _Lane:
    """One thread's two staging chunks, its stream, and the copy last sent from each chunk."""

    def __init__(self, chunks: list[torch.Tensor], device: torch.device) -> None:
        self.chunks = chunks
        self.views = [c.numpy() for c in chunks]
        self.stream = torch.cuda.Stream(device)
        self.sent: list[torch.cuda.Event | None] = [None, None]


class StagedUploader:
    """Upload byte ranges of host arrays to ``device``; one lane per thread, ``lanes`` at most."""

    def __init__(self, device: torch.device, lanes: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._buffer = HostBuffer(2 * lanes * chunk_bytes, device)
        memory = self._buffer.get()
        self._free = [[memory[(2 * i + j) * chunk_bytes:(2 * i + j + 1) * chunk_bytes] for j in range(2)]
                      for i in range(lanes)]
        self._local = threading.local()
        self._lock = threading.Lock()

    def _lane(self) -> _Lane:
        lane = getattr(self._local, "lane", None)
        if lane is None:
            with self._lock:
                if not self._free:
                    raise RuntimeError("more loading threads than staging lanes")
                lane = _Lane(self._free.pop(), self.device)
            self._local.lane = lane
        return lane

    def upload(self, source: np.ndarray) -> torch.Tensor:
        """A new uint8 device tensor holding ``source``'s bytes (a 1-D uint8 array), complete
        when this returns."""
        lane = self._lane()
        out = torch.empty(source.shape[0], dtype=torch.uint8, device=self.device)  # this thread's default stream
        lane.stream.wait_stream(torch.cuda.current_stream(self.device))
        for i, start in enumerate(range(0, source.shape[0], self.chunk_bytes)):
            size = min(self.chunk_bytes, source.shape[0] - start)
            slot = i % 2
            sent = lane.sent[slot]
            if sent is not None:
                sent.synchronize()  # the chunk's previous copy has left it
            np.copyto(lane.views[slot][:size], source[start:start + size])
            with torch.cuda.stream(lane.stream):
                out[start:start + size].copy_(lane.chunks[slot][:size], non_blocking=True)
                event = torch.cuda.Event()
                event.record(lane.stream)
            lane.sent[slot] = event
        lane.stream.synchronize()  # complete before another stream (the caller's) reads it
        return out

    def close(self) -> None:
        self._buffer.release()
