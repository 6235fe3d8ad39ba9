"""One ``cuMemcpyBatchAsync`` per job: the DMA path's driver call, bound with ctypes.

A DMA job is thousands of page copies (16,384 to 40,960 for a 256-block job at
Llama-3.1-8B / Llama-70B shapes). One Python ``cudaMemcpyAsync`` per copy cost
0.28-1.08 us of interpreter time each (measured with a no-op driver) before the
driver's own cost; the batched call takes the descriptors as three arrays, so the host
work per job is numpy over the pairs plus a single foreign call.

Binding: ``cuGetProcAddress`` on ``libcuda.so.1`` asked for the CUDA 12.8 ABI of
``cuMemcpyBatchAsync`` (nine arguments, with ``failIdx``). CUDA 13 dropped ``failIdx``
from the default symbol (``cuMemcpyBatchAsync_v2``, eight arguments); asking for the
12.8 version by number gets the same nine-argument entry point from every driver that
has one (12.8 and later), so one signature serves both. Drivers before 12.8, or a
failed lookup, leave the DMA path on its per-run loop, and the reason is reported.

The descriptors must be host memory that stays valid during the call (the driver
reads them while enqueuing); the engine keeps them until the job ends anyway.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

#: CUDA version whose ABI of cuMemcpyBatchAsync is bound (the first that has it).
BATCH_ABI_VERSION = 12080
#: CUmemcpySrcAccessOrder: read the source in stream order. The source of a store is
#: the KV cache that compute may still be writing until the job's wait event, so the
#: driver must not read it early.
SRC_ACCESS_ORDER_STREAM = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, location hints (unset), flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


#: CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
#: size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
#: size_t *failIdx, CUstream hStream) -- the 12.8 ABI.
BATCH_FUNCTION = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)


class BatchCopy:
    """Enqueue many copies with one driver call; descriptors are numpy arrays.

    ``function`` is the bound entry point (a ``BATCH_FUNCTION``; tests pass a Python
    stand-in wrapped in it, so the arguments cross the same ctypes boundary).
    ``calls`` counts driver calls (one per job and direction).
    """

    def __init__(self, function: Any, source: str) -> None:
        self._function = function
        self.source = source
        self._attributes = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._attribute_index = ctypes.c_size_t(0)
        self._fail_index = ctypes.c_size_t(0)
        self.calls = 0

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy ``sizes[i]`` bytes ``srcs[i] -> dsts[i]`` for every i, in stream order.

        The arrays are 1-d contiguous uint64 of one length (checked: an internal
        invariant of the copier that builds them).
        """
        count = sizes.size
        assert dsts.size == srcs.size == count and dsts.dtype == srcs.dtype == np.uint64
        assert sizes.dtype == np.uint64 and all(a.flags.c_contiguous for a in (dsts, srcs, sizes))
        if count == 0:
            return
        self.calls += 1
        code = self._function(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            count,
            ctypes.addressof(self._attributes),
            ctypes.addressof(self._attribute_index),
            1,
            ctypes.addressof(self._fail_index),
            stream,
        )
        if code != 0:
            raise RuntimeError(
                f"cuMemcpyBatchAsync of {count} copies failed with CUDA error {code} at "
                f"copy {self._fail_index.value} ({self.source})"
            )


def stand_in(copy: Callable[..., int], source: str = "stand-in") -> BatchCopy:
    """A ``BatchCopy`` around a Python function with the driver's nine arguments."""
    return BatchCopy(BATCH_FUNCTION(copy), source)


def find_batch_copy(driver: Any = None) -> tuple[BatchCopy | None, str]:
    """The batched call if this driver has it, else None; and a line saying which/why.

    ``driver``: a loaded ``libcuda`` (default: ``libcuda.so.1``).
    """
    try:
        if driver is None:
            driver = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        driver.cuDriverGetVersion(ctypes.byref(version))
    except (OSError, AttributeError) as error:
        return None, f"per-run cudaMemcpyAsync loop (no CUDA driver: {error})"
    major, minor = version.value // 1000, version.value % 1000 // 10
    if version.value < BATCH_ABI_VERSION:
        return None, (
            f"per-run cudaMemcpyAsync loop (driver API {major}.{minor} has no "
            "cuMemcpyBatchAsync; it needs 12.8)"
        )
    pointer = ctypes.c_void_p()
    try:
        lookup = driver.cuGetProcAddress_v2
        status = ctypes.c_int(0)
        lookup.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        lookup.restype = ctypes.c_int
        code = lookup(
            b"cuMemcpyBatchAsync", ctypes.byref(pointer), BATCH_ABI_VERSION, 0, ctypes.byref(status)
        )
    except AttributeError:
        return None, "per-run cudaMemcpyAsync loop (the driver has no cuGetProcAddress_v2)"
    if code != 0 or not pointer.value:
        return None, (
            f"per-run cudaMemcpyAsync loop (cuGetProcAddress(cuMemcpyBatchAsync, 12.8) "
            f"failed: CUDA error {code}, status {status.value})"
        )
    source = f"cuMemcpyBatchAsync, driver API {major}.{minor}"
    return BatchCopy(BATCH_FUNCTION(pointer.value), source), source


__all__ = [
    "BATCH_ABI_VERSION",
    "BATCH_FUNCTION",
    "BatchCopy",
    "MemcpyAttributes",
    "find_batch_copy",
    "stand_in",
]
