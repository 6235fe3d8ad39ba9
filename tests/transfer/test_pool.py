"""The ctypes bindings of triton_offload.transfer.pool, checked without a GPU.

Each CUDA entry point is replaced by a C function pointer (a ctypes callback with the
real C prototype) reached through a bare, CDLL-style pointer, as ``ctypes.CDLL``
would hand it out: the bindings must set ``argtypes``/``restype`` themselves, or a
64-bit address or size is truncated / refused on the way in. The pool allocation is
then driven through a stand-in API: pieces, one linear device mapping, unregistration,
and the fallback to torch's pinned allocator when registration is refused.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from typing import Any

import pytest
import torch

from triton_offload.transfer import pool as pool_module
from triton_offload.transfer.pool import CudaApi, allocate_pool, piece_ranges

HIGH_ADDRESS = 0x7F3A_1234_5000  # above 4 GiB: a 32-bit argument would lose it
DEVICE_ADDRESS = 0x7F00_DEAD_B000
BIG_SIZE = 5 << 30  # above 4 GiB: a 32-bit size_t would lose it
STREAM = 0x5555_6666_7777

_BARE = ctypes.CDLL(None)._FuncPtr  # what CDLL returns for a symbol: no argtypes, int result


class FakeLibrary:
    """C function pointers with the real prototypes; ``codes`` sets each one's result."""

    def __init__(self, prototypes: dict[str, tuple[Any, ...]]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.codes: dict[str, int] = {}
        self._callbacks = []
        for name, (restype, *argtypes) in prototypes.items():
            callback = ctypes.CFUNCTYPE(restype, *argtypes)(self._recorder(name))
            self._callbacks.append(callback)
            address = ctypes.cast(callback, ctypes.c_void_p).value
            setattr(self, name, _BARE(address))

    def _recorder(self, name: str) -> Any:
        def call(*args: Any) -> int:
            if name in ("cudaHostGetDevicePointer", "cuMemHostGetDevicePointer_v2"):
                out, host = args[0], args[1]
                out[0] = host - HIGH_ADDRESS + DEVICE_ADDRESS
                args = args[1:]
            self.calls.append((name, args))
            return self.codes.get(name, 0)

        return call


def runtime_library() -> FakeLibrary:
    c = ctypes
    return FakeLibrary(
        {
            "cudaHostRegister": (c.c_int, c.c_void_p, c.c_size_t, c.c_uint),
            "cudaHostUnregister": (c.c_int, c.c_void_p),
            "cudaHostGetDevicePointer": (c.c_int, c.POINTER(c.c_void_p), c.c_void_p, c.c_uint),
            "cudaMemcpyAsync": (c.c_int, c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p),
            "cudaGetLastError": (c.c_int,),
        }
    )


def driver_library() -> FakeLibrary:
    c = ctypes
    return FakeLibrary(
        {
            "cuMemHostRegister_v2": (c.c_int, c.c_void_p, c.c_size_t, c.c_uint),
            "cuMemHostUnregister": (c.c_int, c.c_void_p),
            # CUdeviceptr is an unsigned 64-bit integer
            "cuMemHostGetDevicePointer_v2": (
                c.c_int,
                c.POINTER(c.c_uint64),
                c.c_void_p,
                c.c_uint,
            ),
            "cuMemcpyAsync": (c.c_int, c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p),
        }
    )


def test_bare_pointer_truncates_without_argtypes() -> None:
    """The stand-in is faithful: an unbound call masks a 64-bit address to a C int."""
    lib = runtime_library()
    lib.cudaHostRegister(HIGH_ADDRESS, BIG_SIZE, 3)
    ((_, (address, size, _)),) = lib.calls
    assert address != HIGH_ADDRESS and size != BIG_SIZE


@pytest.mark.parametrize("kind", ["runtime", "driver"])
def test_64_bit_arguments_arrive_intact(kind: str) -> None:
    lib = runtime_library() if kind == "runtime" else driver_library()
    api = CudaApi(**{kind: lib})
    api.register(HIGH_ADDRESS, BIG_SIZE)
    assert api.device_pointer(HIGH_ADDRESS + 4096) == DEVICE_ADDRESS + 4096
    api.memcpy_async(DEVICE_ADDRESS, HIGH_ADDRESS, BIG_SIZE, STREAM)
    api.unregister(HIGH_ADDRESS)
    names = {
        "runtime": (
            "cudaHostRegister",
            "cudaHostGetDevicePointer",
            "cudaMemcpyAsync",
            "cudaHostUnregister",
        ),
        "driver": (
            "cuMemHostRegister_v2",
            "cuMemHostGetDevicePointer_v2",
            "cuMemcpyAsync",
            "cuMemHostUnregister",
        ),
    }[kind]
    memcpy_args = (DEVICE_ADDRESS, HIGH_ADDRESS, BIG_SIZE)
    memcpy_args += (4, STREAM) if kind == "runtime" else (STREAM,)  # 4: cudaMemcpyDefault
    assert lib.calls == [
        (names[0], (HIGH_ADDRESS, BIG_SIZE, 3)),  # portable | mapped (device map)
        (names[1], (HIGH_ADDRESS + 4096, 0)),
        (names[2], memcpy_args),
        (names[3], (HIGH_ADDRESS,)),
    ]
    for function in (api._register, api._unregister, api._device_pointer):
        assert function.restype is ctypes.c_int


def test_runtime_errors_raise_and_clear_the_last_error(caplog: pytest.LogCaptureFixture) -> None:
    lib = runtime_library()
    api = CudaApi(runtime=lib)
    lib.codes = {
        "cudaHostRegister": 712,  # cudaErrorHostMemoryAlreadyRegistered
        "cudaHostGetDevicePointer": 1,
        "cudaMemcpyAsync": 1,
        "cudaHostUnregister": 713,
    }
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        api.register(HIGH_ADDRESS, 4096)
    with pytest.raises(RuntimeError, match="no device address"):
        api.device_pointer(HIGH_ADDRESS)
    with pytest.raises(RuntimeError, match="async copy"):
        api.memcpy_async(1, 2, 3, STREAM)
    with caplog.at_level(logging.WARNING, logger="triton_offload.transfer.pool"):
        api.unregister(HIGH_ADDRESS)  # cleanup: logged, not raised
    assert "CUDA error 713" in caplog.text
    cleared = [name for name, _ in lib.calls if name == "cudaGetLastError"]
    assert len(cleared) == 4  # one per failed call: torch would report it later otherwise


class StandInApi:
    """Host memory 'registered' by bookkeeping; device address = host address + shift."""

    def __init__(self, shift: int = 0x1000_0000, scatter: bool = False) -> None:
        self.shift = shift
        self.scatter = scatter
        self.registered: dict[int, int] = {}
        self.refuse = False

    def register(self, address: int, size: int) -> None:
        if self.refuse:
            raise RuntimeError("registering failed with CUDA error 801 (stand-in)")
        assert address % 4096 == 0 and address not in self.registered
        self.registered[address] = size

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def device_pointer(self, address: int) -> int:
        extra = (len(self.registered) << 40) if self.scatter else 0
        return address + self.shift + extra


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(api: StandInApi) -> StandInApi:
        monkeypatch.setattr(pool_module, "cuda_api", lambda: api)
        monkeypatch.setattr(
            pool_module, "_pinned_zeros", lambda n: torch.zeros(n, dtype=torch.uint8)
        )
        return api

    return use


def test_pool_registered_in_page_pieces_with_one_mapping(stand_in: Any) -> None:
    api = stand_in(StandInApi())
    # Rows of half a page: pieces of two rows (one page), the most under 5000 bytes.
    pool = allocate_pool(5, 2048, pinned=True, piece_bytes=5000)
    assert pool.locked_by == "cudaHostRegister"
    base = pool.tensor.data_ptr()
    assert base % 4096 == 0
    assert api.registered == {base: 4096, base + 4096: 4096, base + 8192: 2048}
    assert pool.device_address == base + api.shift
    assert pool.tensor.shape == (5, 2048) and not pool.tensor.any()
    pool.close()
    assert api.registered == {}
    pool.close()  # idempotent


@pytest.mark.parametrize("failure", ["refused", "scattered"])
def test_pool_falls_back_to_torch_pinned_memory(
    stand_in: Any, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    api = stand_in(StandInApi(scatter=failure == "scattered"))
    api.refuse = failure == "refused"
    with caplog.at_level(logging.WARNING, logger="triton_offload.transfer.pool"):
        pool = allocate_pool(4, 4096, pinned=True, piece_bytes=4096)
    assert "torch's pinned allocator" in caplog.text
    assert api.registered == {}  # pieces registered before the failure are unlocked
    assert pool.locked_by == "pin_memory" and pool.pinned
    assert pool.device_address == pool.tensor.data_ptr() + api.shift
    assert pool.tensor.shape == (4, 4096)
    pool.close()


def test_pool_fallback_failure_names_both_causes(
    stand_in: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = stand_in(StandInApi())
    api.refuse = True

    def no_pinned(n: int) -> torch.Tensor:
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(pool_module, "_pinned_zeros", no_pinned)
    with pytest.raises(RuntimeError, match=r"CUDA error 801.*out of pinned memory"):
        allocate_pool(2, 4096, pinned=True)


@pytest.mark.parametrize(
    ("rows", "row_bytes", "piece_bytes", "expected"),
    [
        # Page-multiple rows: as many whole rows as fit, at least one.
        (5, 8192, 20000, [(0, 16384), (16384, 16384), (32768, 8192)]),
        (3, 8192, 1, [(0, 8192), (8192, 8192), (16384, 8192)]),
        # Rows of 1.5 pages end on a page every second row: pieces of two rows.
        (5, 6144, 1, [(0, 12288), (12288, 12288), (24576, 6144)]),
        (5, 6144, 30000, [(0, 24576), (24576, 6144)]),
        # 3000-byte rows meet a page boundary only every 512 rows: one piece here.
        (5, 3000, 5000, [(0, 15000)]),
        (1030, 3000, 1, [(0, 512 * 3000), (512 * 3000, 512 * 3000), (1024 * 3000, 6 * 3000)]),
    ],
)
def test_pool_pieces_end_on_row_and_page_boundaries(
    rows: int, row_bytes: int, piece_bytes: int, expected: list[tuple[int, int]]
) -> None:
    pieces = piece_ranges(rows, row_bytes, piece_bytes, page=4096)
    assert pieces == expected
    assert sum(length for _, length in pieces) == rows * row_bytes
    for (offset, length), (following, _) in itertools.pairwise(pieces):
        assert offset + length == following
        assert following % row_bytes == 0 and following % 4096 == 0


def test_engine_sized_pool_pieces_hold_whole_rows() -> None:
    """The engine's rows are 16-byte multiples: at most page / 16 rows per period."""
    for row_bytes in (16, 4112, 65552, 3 * 4096 + 16, 1 << 20):
        pieces = piece_ranges(300, row_bytes, 64 << 10, page=4096)
        assert all(offset % row_bytes == 0 and offset % 4096 == 0 for offset, _ in pieces)
        assert max(length for _, length in pieces) <= max(64 << 10, 256 * row_bytes)


class RangeLockingApi(StandInApi):
    """A stand-in whose ``device_pointer`` answers only inside registered ranges, as
    ``cudaHostGetDevicePointer`` does (pageable memory has no device address)."""

    def device_pointer(self, address: int) -> int:
        for start, size in self.registered.items():
            if start <= address < start + size:
                return address + self.shift
        raise RuntimeError(f"no device address for host memory at {address:#x} (stand-in)")


def test_wrapped_pool_page_locked_outside_torch_is_accepted(stand_in: Any) -> None:
    """vLLM's shared region locks its memory with cudaHostRegister; torch 2.11's
    ``is_pinned()`` answers False for such memory (seen on an H200), so a check that asks
    torch refused the region as pageable and the worker could not start on a GPU."""
    api = stand_in(RangeLockingApi())
    backing = torch.zeros(4 * 4096 + 4096, dtype=torch.uint8)
    start = -backing.data_ptr() % 4096
    tensor = backing[start : start + 4 * 4096].view(4, 4096)
    assert not tensor.is_pinned()
    api.registered[tensor.data_ptr()] = tensor.numel()
    pool = pool_module.wrap_pool(tensor, rows=4, row_bytes=4096, cuda=True)
    assert pool.pinned and pool.locked_by == "cudaHostRegister"
    assert pool.device_address == tensor.data_ptr() + api.shift


def test_wrapped_pool_locked_only_in_part_is_refused(stand_in: Any) -> None:
    api = stand_in(RangeLockingApi())
    backing = torch.zeros(4 * 4096 + 4096, dtype=torch.uint8)
    start = -backing.data_ptr() % 4096
    tensor = backing[start : start + 4 * 4096].view(4, 4096)
    with pytest.raises(ValueError, match="pool is pageable host memory"):
        pool_module.wrap_pool(tensor, rows=4, row_bytes=4096, cuda=True)
    api.registered[tensor.data_ptr()] = 2 * 4096  # rows 0-1 locked, rows 2-3 pageable
    with pytest.raises(ValueError, match=r"row 3 .* is not page-locked"):
        pool_module.wrap_pool(tensor, rows=4, row_bytes=4096, cuda=True)
