"""The host memory that holds the weights during sleep level 1: the weights' exact size,
page-locked once, and prepared off the request path.

torch's pinned allocator rounds a request up to a power of two (16.4 GB of weights → 32 GiB
pinned) and pins it when it is asked for: at the first sleep, which on the H200 machine then
took 11 s. Here the buffer is anonymous memory of the exact size, touched page by page (so the
kernel maps it) and then page-locked with ``cudaHostRegister``; ``prepare_in_background`` does
that on a thread once the engine is up, so the first sleep finds the buffer ready and only copies.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time

import torch

logger = logging.getLogger(__name__)


class HostBuffer:
    """``nbytes`` of host memory as a uint8 tensor; page-locked when ``device`` is a GPU."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.prepare_seconds: float | None = None  # how long allocating and locking took
        self._tensor: torch.Tensor | None = None
        self._memory: mmap.mmap | None = None
        self._registered = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._tensor is not None

    def prepare_in_background(self) -> None:
        """Allocate and lock the buffer on a thread; ``get`` waits for it."""
        with self._lock:
            if self._thread is not None or self._tensor is not None:
                return
            # Not a daemon: a process that exits meanwhile waits for it (a second or two) rather
            # than abort while the thread is inside the CUDA runtime.
            self._thread = threading.Thread(target=self._prepare_catching, name="tidal-host-buffer", daemon=False)
            self._thread.start()

    def get(self) -> torch.Tensor:
        """The buffer (prepared now if no thread has done it yet)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if self._tensor is None:
                if self._error is not None:  # the thread failed: say so once, then lock it the plain way
                    logger.warning("the host buffer could not be prepared ahead (%r); pinning it now", self._error)
                    self._error = None
                    self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                else:
                    self._prepare()
            assert self._tensor is not None
            return self._tensor

    def release(self) -> None:
        """Unlock and free the memory (nothing may be copying into or out of it)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if self._registered and self._tensor is not None:
                torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self._registered = False
            self._tensor = None
            self._memory = None  # unmapped once the last view of it is gone
            self._thread = None

    def _prepare_catching(self) -> None:
        try:
            with self._lock:
                if self._tensor is None:
                    self._prepare()
        except Exception as exc:  # noqa: BLE001 - reported by get(), which falls back
            self._error = exc

    def _prepare(self) -> None:
        started = time.perf_counter()
        if self.device.type != "cuda":
            self._tensor = torch.empty(self.nbytes, dtype=torch.uint8)
            self.prepare_seconds = time.perf_counter() - started
            return
        memory = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)  # fewer, larger pages to map and lock, where allowed
        tensor = torch.frombuffer(memory, dtype=torch.uint8)
        tensor.fill_(0)  # maps every page now (torch's CPU threads, without the GIL), not inside the lock
        if self.device.index is not None:
            torch.cuda.set_device(self.device.index)  # this thread's calls go to the engine's device
        status = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), self.nbytes, 0))
        if status != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {status}")
        self._memory, self._tensor, self._registered = memory, tensor, True
        self.prepare_seconds = time.perf_counter() - started
        logger.info("page-locked host buffer: %.2f GiB in %.2f s", self.nbytes / 2**30, self.prepare_seconds)

    def __del__(self) -> None:
        try:
            if self._registered and self._tensor is not None:
                torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
        except Exception:  # noqa: BLE001 - interpreter shutdown: the runtime may be gone
            pass
