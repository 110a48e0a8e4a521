"""A device address range whose physical memory can be given back and taken again.

CUDA graphs bake in the addresses of the weights and of the KV cache. A range reserved once
(``cuMemAddressReserve``) keeps its addresses while its physical memory is unmapped
(sleep) and mapped again (wake), so the captured graphs stay valid across sleep and wake and
nothing is re-captured or re-profiled: wake is a map plus one copy. This is the CUDA driver's
virtual memory API (the one vLLM's sleep-mode allocator uses), called through ctypes.

``VmmRange.create`` returns None where the driver or the device lacks the API; the callers
then fall back to ordinary allocations (and re-capture the graphs after a wake).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: Any = None


def _cuda() -> Any:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


class _DeviceArray:
    """What ``torch.as_tensor`` needs to view raw device memory (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class VmmRange:
    """``nbytes`` of device memory at a fixed address; ``unmap``/``map`` give the physical memory
    back and take it again (the contents are lost in between)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(device)  # makes the primary context current on this thread
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, index)
        self._access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, index), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        granularity = ctypes.c_size_t()
        _check(_cuda().cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                     _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        step = max(1, granularity.value)
        self.nbytes = nbytes
        self.size = max(step, -(-nbytes // step) * step)
        ptr = ctypes.c_uint64()
        _check(_cuda().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                           ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        self._handle: ctypes.c_uint64 | None = None
        self.map()
        self.tensor = torch.as_tensor(_DeviceArray(self.ptr, nbytes), device=device)

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> "VmmRange | None":
        """A mapped range, or None where the driver API is unavailable (then allocate plainly)."""
        if device.type != "cuda":
            return None
        try:
            return cls(nbytes, device)
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.warning("no fixed-address device memory (%s): sleep and wake re-capture the CUDA graphs", exc)
            return None

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        if self._handle is not None:
            return
        handle = ctypes.c_uint64()
        _check(_cuda().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self._prop),
                                   ctypes.c_ulonglong(0)), "cuMemCreate")
        try:
            _check(_cuda().cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                    handle, ctypes.c_ulonglong(0)), "cuMemMap")
            _check(_cuda().cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size),
                                          ctypes.byref(self._access), ctypes.c_size_t(1)), "cuMemSetAccess")
        except RuntimeError:
            _cuda().cuMemRelease(handle)
            raise
        self._handle = handle

    def unmap(self) -> None:
        """Give the physical memory back (the device must be done with it: synchronize first)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        _check(_cuda().cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemUnmap")
        _check(_cuda().cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def __del__(self) -> None:  # the address range goes back with the object
        try:
            self.unmap()
            _cuda().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass
