"""Host pool allocation: ``rows`` x ``row_bytes`` bytes, one chunk of one group per row.

On CUDA the pool is ordinary host memory that is page-locked with
``cudaHostRegister`` in pieces of whole rows (about ``piece_bytes`` each) rather than one
``torch.empty(pin_memory=True)``: torch's pinned allocator rounds every request up to
a power of two (a 40 GiB pool would lock 64 GiB), and locking hundreds of GiB in one
call can fail or stall where smaller pieces succeed. Kernels reach the pool through
the device-visible address that ``cudaHostGetDevicePointer`` returns for it; the
host address is never assumed to be valid on the device. Without CUDA the pool is
plain memory and its device address is its host address.

The CUDA runtime is called through ctypes on the ``libcudart`` that torch already
loaded (found in ``/proc/self/maps``), falling back to the driver API in
``libcuda.so.1``. None of this runs without a GPU. A failed runtime call also leaves
its error as the thread's "last error", which torch would report at its next kernel
launch as if that launch had failed; every failed call here clears it.

Where ``cudaHostRegister`` is refused (some sandboxes and container runtimes do not
support locking ordinary memory), the pool falls back to torch's pinned allocator,
with a warning: it rounds the size up to a power of two, but the pool still works.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Size of each ``cudaHostRegister`` call (whole rows, see ``piece_ranges``). 1 GiB keeps a
#: single registration short (it touches and locks every page) while a 100 GiB pool
#: needs only ~100 calls.
DEFAULT_PIECE_BYTES = 1 << 30

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_CUDA_MEMCPY_DEFAULT = 4


class CudaApi:
    """The few CUDA calls torch does not expose: host registration and raw async copies.

    ``register``/``unregister``/``device_pointer`` of page-locked host memory and
    ``memcpy_async`` between unified addresses on a raw stream handle.
    """

    def __init__(self, *, runtime: Any = None, driver: Any = None) -> None:
        """Bind the calls on ``runtime`` (a libcudart handle) or else ``driver`` (libcuda).

        With neither, the libcudart torch loaded is found, else ``libcuda.so.1`` is
        opened. (Tests pass stand-in libraries to check the bindings' C signatures.)
        """
        self._register: Any  # ctypes function pointers: argtypes and restype are set below
        self._unregister: Any
        self._device_pointer: Any
        self._clear_error: Callable[[], object] = lambda: None
        if runtime is None and driver is None:
            runtime = self._find_runtime()
        if runtime is not None:
            self._register = runtime.cudaHostRegister
            self._unregister = runtime.cudaHostUnregister
            self._device_pointer = runtime.cudaHostGetDevicePointer
            runtime_copy = runtime.cudaMemcpyAsync
            runtime_copy.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            runtime_copy.restype = ctypes.c_int

            def copy(dst: int, src: int, size: int, stream: int) -> int:
                return int(runtime_copy(dst, src, size, _CUDA_MEMCPY_DEFAULT, stream))

            self._memcpy: Callable[[int, int, int, int], int] = copy
            last_error = runtime.cudaGetLastError
            last_error.argtypes = []
            last_error.restype = ctypes.c_int
            self._clear_error = last_error
            self.source = f"runtime {getattr(runtime, '_name', runtime)}"
        else:
            if driver is None:
                driver = ctypes.CDLL("libcuda.so.1")
            self._register = driver.cuMemHostRegister_v2
            self._unregister = driver.cuMemHostUnregister
            self._device_pointer = driver.cuMemHostGetDevicePointer_v2
            driver_copy = driver.cuMemcpyAsync
            driver_copy.argtypes = [
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]
            driver_copy.restype = ctypes.c_int
            self._memcpy = lambda dst, src, size, stream: int(driver_copy(dst, src, size, stream))
            self.source = f"driver {getattr(driver, '_name', driver)}"
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._device_pointer.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        self._device_pointer.restype = ctypes.c_int

    @staticmethod
    def _find_runtime() -> ctypes.CDLL | None:
        paths: list[str] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    path = line.rsplit(None, 1)[-1]
                    if "libcudart" in path and path.startswith("/") and path not in paths:
                        paths.append(path)
        except OSError:
            pass
        for path in paths:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
        return None

    def register(self, address: int, size: int) -> None:
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        code = self._register(address, size, flags)
        if code != 0:
            self._clear_error()
            raise RuntimeError(
                f"registering {size} bytes of host memory at {address:#x} failed with "
                f"CUDA error {code} ({self.source})"
            )

    def unregister(self, address: int) -> None:
        """Unlock the registration at ``address``; a failure is logged, not raised (cleanup)."""
        code = self._unregister(address)
        if code != 0:
            self._clear_error()
            logger.warning(
                "unregistering host memory at %#x failed with CUDA error %d (%s)",
                address,
                code,
                self.source,
            )

    def device_pointer(self, address: int) -> int:
        out = ctypes.c_void_p()
        code = self._device_pointer(ctypes.byref(out), address, 0)
        if code != 0 or out.value is None:
            self._clear_error()
            raise RuntimeError(
                f"no device address for host memory at {address:#x}: CUDA error {code} "
                f"({self.source})"
            )
        return int(out.value)

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        """Enqueue one copy between unified addresses on the raw stream handle."""
        code = self._memcpy(dst, src, size, stream)
        if code != 0:
            self._clear_error()
            raise RuntimeError(
                f"async copy of {size} bytes {src:#x} -> {dst:#x} failed with CUDA error "
                f"{code} ({self.source})"
            )


_CUDA_API: CudaApi | None = None


def cuda_api() -> CudaApi:
    """The process-wide ``CudaApi`` (created on first use; needs a CUDA machine)."""
    global _CUDA_API
    if _CUDA_API is None:
        _CUDA_API = CudaApi()
    return _CUDA_API


def device_address_of_pinned(tensor: torch.Tensor) -> int:
    """Device-visible address of the first byte of a page-locked CPU tensor."""
    return cuda_api().device_pointer(tensor.data_ptr())


@dataclass
class HostPool:
    """The host pool: ``tensor`` is uint8 ``[rows, row_bytes]``, rows ``row_stride`` apart.

    ``device_address`` is the address kernels use for row 0 (equal to the host
    address without CUDA). ``pinned`` says whether the memory is page-locked;
    ``locked_by`` how: ``"cudaHostRegister"`` (in pieces), ``"pin_memory"`` (torch's
    pinned allocator: the fallback, or a caller's pinned tensor), ``""`` when not pinned.
    """

    tensor: torch.Tensor
    device_address: int
    pinned: bool
    locked_by: str = ""
    _pieces: list[int] = field(default_factory=list, repr=False)
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return self.tensor.size(0)

    @property
    def row_bytes(self) -> int:
        return self.tensor.size(1)

    @property
    def row_stride(self) -> int:
        """Bytes between the starts of consecutive rows (>= ``row_bytes``)."""
        return row_stride_of(self.tensor)

    def close(self) -> None:
        """Unregister the pages this pool locked, then let go of its memory (idempotent):
        ``tensor`` becomes an empty ``[0, row_bytes]`` tensor. A pool over a caller's
        memory is a view of it, and the owner cannot unmap memory a view still exports
        (vLLM's shared region then stays mapped: "Keeping ... mapped")."""
        if self._finalizer is not None:
            self._finalizer()
        self.tensor = torch.empty(
            (0, self.tensor.size(1)), dtype=self.tensor.dtype, device=self.tensor.device
        )


def _unregister_all(pieces: list[int], keep_alive: torch.Tensor) -> None:
    del keep_alive
    api = cuda_api()
    for address in pieces:
        api.unregister(address)
    pieces.clear()


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def piece_ranges(
    rows: int, row_bytes: int, piece_bytes: int, page: int = mmap.PAGESIZE
) -> list[tuple[int, int]]:
    """(offset, length) of each ``cudaHostRegister`` piece of a ``rows x row_bytes`` pool.

    Pieces hold whole rows, so no page of a row (and no copy: a DMA run never leaves its
    row) straddles two registrations, as in the vLLM region's ``lock_ranges``: a batched
    copy across two registrations is a case the driver is never given. Every piece but
    the last is also a whole number of OS pages (the pool starts on a page), so no page
    is registered twice: rows per piece are a multiple of ``page / gcd(page,
    row_bytes)`` (1 when rows are page multiples; at most ``page / 16`` rows for the
    engine's 16-byte-rounded rows), as many as fit in ``piece_bytes`` but at least that
    period.
    """
    period = page // math.gcd(page, row_bytes)
    rows_per_piece = max(period, piece_bytes // row_bytes // period * period)
    step = rows_per_piece * row_bytes
    total = rows * row_bytes
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


def allocate_pool(
    rows: int,
    row_bytes: int,
    *,
    pinned: bool,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> HostPool:
    """Allocate a zero-filled pool; page-lock it when ``pinned``, in the pieces of
    :func:`piece_ranges` (whole rows, about ``piece_bytes`` each)."""
    if rows < 1:
        raise ValueError(f"num_host_blocks {rows} must be >= 1")
    if row_bytes < 1:
        raise ValueError(f"row_bytes {row_bytes} must be >= 1")
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes {piece_bytes} must be >= 1")
    memory = host_memory_bytes()
    if memory is not None and rows * row_bytes > memory:
        # Refused here, naming the argument: torch's allocator error names neither it nor
        # the row size, and a pool near the limit would leave nothing for the caches.
        raise ValueError(
            f"num_host_blocks {rows} x {row_bytes} bytes per row = {rows * row_bytes} bytes "
            f"exceeds this host's {memory} bytes of memory"
        )
    if not pinned:
        tensor = torch.zeros((rows, row_bytes), dtype=torch.uint8)
        return HostPool(tensor=tensor, device_address=tensor.data_ptr(), pinned=False)
    page = mmap.PAGESIZE
    total = rows * row_bytes
    backing = torch.zeros(total + page, dtype=torch.uint8)
    skip = -backing.data_ptr() % page
    tensor = backing[skip : skip + total].view(rows, row_bytes)
    api = cuda_api()
    base = tensor.data_ptr()
    pieces: list[int] = []
    try:
        device_base: int | None = None
        for start, size in piece_ranges(rows, row_bytes, piece_bytes, page):
            api.register(base + start, size)
            pieces.append(base + start)
            address = api.device_pointer(base + start)
            if device_base is None:
                device_base = address
            elif address != device_base + start:
                # The kernels address the whole pool from one base; pieces mapped at
                # unrelated device addresses cannot be reached that way.
                raise RuntimeError(
                    f"pinned pool piece at offset {start} maps to device address "
                    f"{address:#x}, not {device_base + start:#x}; the pool needs one "
                    "linear device mapping (unified addressing)"
                )
    except RuntimeError as error:
        _unregister_all(pieces, tensor)
        del tensor, backing
        return _torch_pinned_pool(rows, row_bytes, error)
    except BaseException:
        _unregister_all(pieces, tensor)
        raise
    assert device_base is not None
    pool = HostPool(
        tensor=tensor,
        device_address=device_base,
        pinned=True,
        locked_by="cudaHostRegister",
        _pieces=pieces,
    )
    # Unregister before the memory can be freed: the finalizer holds the tensor.
    pool._finalizer = weakref.finalize(pool, _unregister_all, pieces, tensor)
    return pool


def _pinned_zeros(size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.uint8, pin_memory=True)


def _torch_pinned_pool(rows: int, row_bytes: int, why: Exception) -> HostPool:
    """The pool from torch's pinned allocator, when registering ordinary memory failed."""
    total = rows * row_bytes
    logger.warning(
        "page-locking the %d-byte host pool with cudaHostRegister failed (%s); using "
        "torch's pinned allocator instead, which locks the size rounded up to a power of two",
        total,
        why,
    )
    try:
        tensor = _pinned_zeros(total).view(rows, row_bytes)
    except RuntimeError as error:
        raise RuntimeError(
            f"could not pin a host pool of {total} bytes: cudaHostRegister failed ({why}) "
            f"and torch's pinned allocator failed ({error})"
        ) from error
    return HostPool(tensor, device_address_of_pinned(tensor), pinned=True, locked_by="pin_memory")


def row_stride_of(tensor: torch.Tensor) -> int:
    """Row stride in bytes of a 2-D uint8 pool tensor (its row length when it has one row)."""
    return int(tensor.stride(0)) if tensor.size(0) > 1 else int(tensor.size(1))


def wrap_pool(tensor: torch.Tensor, *, rows: int, row_bytes: int, cuda: bool) -> HostPool:
    """Use a caller-provided pool tensor: uint8 ``[rows, row_bytes]`` with contiguous rows.

    Rows may be spaced wider than ``row_bytes`` (``stride(0) >= row_bytes``, e.g. one
    worker's part of a shared region whose chunk ``k`` sits at ``base + k * stride``);
    the bytes between rows are never touched. With CUDA, a CPU pool must be page-locked
    (pageable memory can be neither reached by the kernels nor copied asynchronously);
    a pool in device memory is used as is.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        # A meta tensor has no memory: its address 0 was copied to (a segfault).
        raise ValueError(
            f"pool is on {tensor.device}; it must be host memory (or CUDA memory on the "
            "caches' GPU)"
        )
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (rows, row_bytes):
        raise ValueError(
            f"pool must be a uint8 tensor of shape {(rows, row_bytes)}, got dtype "
            f"{tensor.dtype} with shape {tuple(tensor.shape)}"
        )
    if row_bytes > 1 and tensor.stride(1) != 1:
        raise ValueError(
            f"pool rows must be contiguous (stride(1) == 1), got strides {tensor.stride()}"
        )
    if rows > 1 and tensor.stride(0) < row_bytes:
        raise ValueError(
            f"pool row stride {tensor.stride(0)} bytes is smaller than the {row_bytes} bytes "
            "of a row: rows would overlap"
        )
    if tensor.device.type == "cpu" and cuda:
        return _wrap_page_locked(tensor, rows, row_bytes)
    return HostPool(tensor, tensor.data_ptr(), pinned=False)


def _wrap_page_locked(tensor: torch.Tensor, rows: int, row_bytes: int) -> HostPool:
    """A caller's CPU pool on a CUDA host: page-locked from its first to its last byte,
    and reached by the kernels through one linear device mapping.

    CUDA is asked, not torch: torch 2.11's ``is_pinned()`` answers False for memory
    locked with ``cudaHostRegister`` (seen on an H200), which is how vLLM's shared region
    is locked, so asking torch refused every region as pageable. Both ends are checked:
    a pool locked only in part would fault or read stale bytes in its unlocked rows.
    """
    api = cuda_api()
    first = tensor.data_ptr()
    try:
        device_first = api.device_pointer(first)
    except RuntimeError as error:
        raise ValueError(
            "pool is pageable host memory; with CUDA the host pool must be page-locked "
            f"(torch.empty(..., pin_memory=True) or cudaHostRegister): {error}"
        ) from None
    last_offset = (rows - 1) * row_stride_of(tensor) + row_bytes - 1
    try:
        device_last = api.device_pointer(first + last_offset)
    except RuntimeError as error:
        raise ValueError(
            f"pool row {rows - 1} (its last byte at host address {first + last_offset:#x}) "
            f"is not page-locked, though row 0 is: lock the whole pool ({error})"
        ) from None
    if device_last != device_first + last_offset:
        raise ValueError(
            f"pool row {rows - 1} maps to device address {device_last:#x}, not "
            f"{device_first + last_offset:#x}: the kernels need one linear device mapping "
            "of the whole pool"
        )
    locked_by = "pin_memory" if tensor.is_pinned() else "cudaHostRegister"
    return HostPool(tensor, device_first, pinned=True, locked_by=locked_by)


__all__ = [
    "DEFAULT_PIECE_BYTES",
    "CudaApi",
    "HostPool",
    "allocate_pool",
    "cuda_api",
    "device_address_of_pinned",
    "host_memory_bytes",
    "piece_ranges",
    "row_stride_of",
    "wrap_pool",
]
