"""The model's parameters as views into one flat device buffer, for fast sleep and wake.

Sleep level 1 copies the parameters into one page-locked host buffer of their exact size
(runner/host_buffer.py: prepared in the background once the engine is up, or at the first
sleep at the latest) and reused by every later one; a wake is one host→device copy into one flat device buffer
whose views the parameters become. Level 2 drops the device memory without a copy; the wake
reloads the checkpoint into the same views.

With ``fixed_addresses`` (sleep mode on CUDA) the parameters move into a ``VmmRange`` at
start-up: its addresses survive sleep, so the CUDA graphs stay valid (``stable_addresses``).
That move needs the weights' size free twice for a moment. Otherwise the parameters keep
their own storage until the first sleep, and the flat buffer is an ordinary tensor, allocated
on wake, with the views re-pointed at it (the runner captures the graphs again).
Buffers (rotary tables, LoRA slots) are not part of the store: they stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal_engine.runner.cuda_vmm import VmmRange
from tidal_engine.runner.host_buffer import HostBuffer

ALIGN = 256


@dataclass
class _Slot:
    param: torch.nn.Parameter
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


def pack_offsets(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Each size's offset in one buffer (aligned), and the buffer's length."""
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // align) * align
        offsets.append(end)
        end += size
    return offsets, end


class WeightStore:
    def __init__(self, model: torch.nn.Module, device: torch.device, fixed_addresses: bool = True) -> None:
        self.device = device
        params = list(dict.fromkeys(model.parameters()))  # tied weights once
        offsets, self.nbytes = pack_offsets([p.numel() * p.element_size() for p in params])
        self._slots = [_Slot(p, off, p.shape, p.dtype) for p, off in zip(params, offsets)]
        self._range = VmmRange.create(self.nbytes, device) if fixed_addresses else None
        self._flat: torch.Tensor | None = None  # None while the parameters keep their own storage
        self._host: HostBuffer | None = None  # the level-1 copy, allocated once
        self.resident = True
        if self._range is not None:
            flat = self._range.tensor
            with torch.no_grad():
                for slot in self._slots:
                    view = self._view(flat, slot)
                    view.copy_(slot.param.data)
                    slot.param.data = view
            self._flat = flat
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the parameters' old storage

    @property
    def stable_addresses(self) -> bool:
        """Whether the parameters keep their device addresses across sleep and wake."""
        return self._range is not None

    @property
    def host_bytes(self) -> int:
        return 0 if self._host is None or not self._host.ready else self.nbytes

    @property
    def host_buffer(self) -> HostBuffer | None:
        return self._host

    def prepare_host_buffer(self) -> None:
        """Start preparing the level-1 host buffer on a thread (a no-op once it exists)."""
        if self._host is None:
            self._host = HostBuffer(self.nbytes, self.device)
        self._host.prepare_in_background()

    @staticmethod
    def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
        return flat[slot.offset: slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    # ---- sleep ---------------------------------------------------------------------------
    def offload(self) -> None:
        """Level 1: one copy into the reused host buffer, then the device memory goes back."""
        if not self.resident:
            return
        if self._host is None:
            self._host = HostBuffer(self.nbytes, self.device)
        host = self._host.get()
        if self._flat is not None:
            host.copy_(self._flat, non_blocking=True)
        else:  # the first sleep of parameters that still have their own storage
            for slot in self._slots:
                self._view(host, slot).copy_(slot.param.data, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._release()

    def discard(self) -> None:
        """Level 2: the device memory goes back without a copy (the host copy too)."""
        if self.resident:
            self._release()
        if self._host is not None:
            self._host.release()
        self._host = None

    def _release(self) -> None:
        if self._range is not None:
            self._range.unmap()  # the views keep their addresses; nothing reads them while asleep
        else:
            for slot in self._slots:
                slot.param.data = torch.empty(0, dtype=slot.dtype, device=self.device)
            self._flat = None
        self.resident = False

    # ---- wake ----------------------------------------------------------------------------
    def onload(self) -> None:
        """Level 1 wake: the device memory back, then one copy from the host buffer."""
        self.acquire()
        assert self._host is not None and self._flat is not None, "onload without an offload"
        self._flat.copy_(self._host.get(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def acquire(self) -> None:
        """Device memory for the parameters again (contents undefined: onload or reload fills it)."""
        if self.resident:
            return
        if self._range is not None:
            self._range.map()
            self._flat = self._range.tensor
        else:
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            for slot in self._slots:
                slot.param.data = self._view(flat, slot)
            self._flat = flat
        self.resident = True
