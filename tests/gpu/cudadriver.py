"""A small ctypes binding of the CUDA driver API (``libcuda.so.1``), and, run as a script, the allocation
checks of ``test_real_gpu.py`` on CUDA device 0 (``CUDA_VISIBLE_DEVICES`` names the card):

    cudadriver.py CAP       waits for a line on stdin (its parent moves it into a cgroup meanwhile), then
                            prints what it found as JSON; CAP: the bytes the driver should cap it at, 0: none

Signatures and constants are those of ``cuda.h`` (CUDA driver API reference, "Memory Management" and
"Virtual Memory Management"): the ``_v2`` entry points are what ``cuda.h`` maps the plain names to.
"""

from __future__ import annotations

import ctypes
import json
import sys

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
MIB = 1 << 20
_PINNED, _LOCATION_DEVICE, _GRANULARITY_MINIMUM = 1, 1, 0


class CudaError(Exception):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class Cuda:
    """One context on CUDA device ``ordinal``."""

    def __init__(self, ordinal: int = 0) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", 0)
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        self._context = ctypes.c_void_p()
        self._device = device
        if hasattr(self._lib, "cuCtxCreate_v2"):
            self.call("cuCtxCreate_v2", ctypes.byref(self._context), 0, device)
        else:  # a driver that dropped the old entry point: the device's primary context
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self._context), device)
            self.call("cuCtxSetCurrent", self._context)
        self._prop = AllocationProp(type=_PINNED, location=_Location(_LOCATION_DEVICE, device.value))

    def try_call(self, name: str, *args: object) -> int:
        return getattr(self._lib, name)(*args)

    def call(self, name: str, *args: object) -> None:
        code = self.try_call(name, *args)
        if code != CUDA_SUCCESS:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorName(code, ctypes.byref(text))
            raise CudaError(name, code, (text.value or b"?").decode())

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes, as ``cuMemGetInfo`` says."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, size: int) -> tuple[int, int]:
        """``cuMemAlloc``: (CUresult, device pointer)."""
        pointer = ctypes.c_uint64()
        return self.try_call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size)), pointer.value

    def free(self, pointer: int) -> None:
        self.call("cuMemFree_v2", ctypes.c_uint64(pointer))

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(self._prop), _GRANULARITY_MINIMUM)
        return size.value

    def create(self, size: int) -> tuple[int, int]:
        """``cuMemCreate`` of physical memory: (CUresult, allocation handle)."""
        handle = ctypes.c_uint64()
        code = self.try_call(
            "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop), ctypes.c_uint64(0)
        )
        return code, handle.value

    def release(self, handle: int) -> None:
        self.call("cuMemRelease", ctypes.c_uint64(handle))

    def close(self) -> None:
        if hasattr(self._lib, "cuCtxCreate_v2"):
            self.call("cuCtxDestroy_v2", self._context)
        else:
            self.call("cuDevicePrimaryCtxRelease_v2", self._device)


def _round_up(size: int, step: int) -> int:
    return -(-size // step) * step


def check(cap: int) -> dict[str, int]:
    """Allocate below ``cap`` and past it (with a part held, so that "past" counts the held part), with
    ``cuMemAlloc`` and then with ``cuMemCreate``; without a cap, 256 MiB each way. The CUresults and
    ``cuMemGetInfo`` before any allocation."""
    cuda = Cuda()
    try:
        free, total = cuda.mem_info()
        step = cuda.granularity()
        below = _round_up(min(256 * MIB, free // 2) if cap else 256 * MIB, step)
        past = _round_up(cap - below + 64 * MIB, step) if cap else 0
        found = {"free": free, "total": total, "granularity": step, "below": below, "past": past}
        # cuMemAlloc, then the virtual memory API (cuMemCreate): below the cap, and past it with that held
        for name, take, give_back in (("alloc", cuda.alloc, cuda.free), ("create", cuda.create, cuda.release)):
            found[f"{name}_below"], held = take(below)
            if cap:
                found[f"{name}_past"], extra = take(past)
                if found[f"{name}_past"] == CUDA_SUCCESS:
                    give_back(extra)
            if found[f"{name}_below"] == CUDA_SUCCESS:
                give_back(held)
        return found
    finally:
        cuda.close()


if __name__ == "__main__":
    sys.stdin.readline()
    print(json.dumps(check(int(sys.argv[1]))))
