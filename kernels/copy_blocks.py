"""Gather/scatter of KV-cache pages between cache planes and pool rows: one launch per job.

A *plane* is one contiguous per-block region of a cache tensor: ``(base address, block
stride, page bytes)``. A K/V FlashAttention tensor ``(2, num_blocks, ...)`` is two planes,
a Mamba layer one plane per state tensor, so page sizes differ inside one job (e.g. two
4 KiB attention planes, a 1,536-byte conv plane and a 64 KiB SSM plane).

The *pool* is a 2-D byte array of rows ``pool_row_bytes`` apart (the row stride, which
may exceed what a row holds; pinned host memory in real use, device or CPU memory in
tests). A row holds one chunk of one group, plane-major: slot ``s`` of plane ``p`` sits
at ``row * pool_row_bytes + pool_offset_p + s * page_bytes_p``.

The static tables (one row per tile of every plane, one row per group) are built,
validated and uploaded once per cache registration by the library, which passes them in
as a :class:`CopyTables`; this module imports nothing of it. Per job only the pair table
travels: ``pairs[n, 3]`` int64 rows
``(gpu_block_id, pool_row, slot)`` ordered by group, with ``group_offsets[num_groups + 1]``;
one pair moves every plane of its group. Host work per job is O(pairs), not
O(pairs x planes).

The kernel is persistent: ``num_programs`` programs walk the flattened
(group, pair, plane, tile) item space with a grid stride; one item is at most
``TILE_BYTES`` of one page. Each item picks its access width at run time from the two
addresses it copies between: 16-byte words when both are 16-byte aligned, 8 or 4 bytes
when only that much alignment holds, single bytes otherwise; a tail shorter than the word
is copied byte by byte, so odd page sizes and odd pool offsets stay exact.

The pool is reached through ``pool_address``, the *device-visible* address of pool row 0
(for pinned host memory: ``tensor.data_ptr()`` of the pinned tensor under unified
addressing, or the pointer from ``cudaHostGetDevicePointer``); the kernel never assumes a
host address is usable on the device.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = [
    "NARROW_BYTES",
    "NUM_WARPS",
    "TILE_BYTES",
    "TILE_COLUMNS",
    "CopyTables",
    "default_num_programs",
    "grid_size",
    "launch_copy",
]

# Bytes one program copies per item: 512 lanes of 16 bytes, i.e. four 16-byte loads in
# flight per thread at NUM_WARPS=4 (16 data registers per thread). Larger tiles only cost
# registers; smaller ones multiply the per-item scalar work (table loads, int64 division).
TILE_BYTES = 8192
# Lanes of the byte path (misaligned items and tails shorter than one word).
NARROW_BYTES = 1024
NUM_WARPS = 4

# Bytes that must be in flight to keep PCIe Gen5 x16 busy: ~55 GB/s x ~2 us host-read
# round trip ~= 110 KB (public reports quote ~100 KB). Each program keeps one item (one
# tile, at most TILE_BYTES) in flight and spends part of every item on table loads and
# the store, so we ask for twice that: with full 8 KiB tiles, 256 KiB / 8 KiB = 32
# programs; with smaller pages (mean tile of 2 KiB: 128 programs) more, up to the SM
# count. 32 of an H100's 132 SMs leaves the rest to the forward pass that runs
# concurrently on the compute stream. Not tuned on a GPU yet: the bench sweep of
# num_programs is the measurement that should replace this estimate.
PCIE_IN_FLIGHT_TARGET_BYTES = 256 * 1024
# The interpreter runs programs one after another; a few programs still exercise the
# grid-stride walk (items owned by several programs, group boundaries mid-stride).
INTERPRETER_NUM_PROGRAMS = 4

#: Columns of a tile-table row (see the kernel's docstring).
TILE_COLUMNS = 5


class CopyTables(Protocol):
    """The static device tables and sizes one launch reads (built once by the caller).

    ``tile_table``: int64 ``[num_tiles, TILE_COLUMNS]`` and ``group_table``: int64
    ``[num_groups, 2]`` on ``device``, as the kernel's docstring describes (tiles cut at
    ``TILE_BYTES``); ``pool_row_bytes``: bytes between pool rows (the row stride);
    ``mean_tile_bytes``: mean item size, which sizes the default grid.
    """

    @property
    def tile_table(self) -> torch.Tensor: ...
    @property
    def group_table(self) -> torch.Tensor: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def pool_row_bytes(self) -> int: ...
    @property
    def mean_tile_bytes(self) -> int: ...
    @property
    def device(self) -> torch.device: ...


@triton.jit
def _copy_words(src, dst, n_words, WORD: tl.constexpr, LANES: tl.constexpr):
    """Copy ``n_words`` words of ``WORD`` bytes; ``src``/``dst`` are WORD-aligned int64 addresses.

    Words of 16 and 8 bytes are moved as 4 / 2 contiguous int32 lanes so Triton emits
    ``ld.global.v4.b32`` / ``v2.b32``: a pointer made from an integer carries no
    alignment, hence the ``tl.multiple_of`` on both pointers. ``n_words * (WORD // 4)``
    keeps the mask constant over each word, so the mask does not split the vector.
    """
    if WORD >= 4:
        src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), WORD)
        dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), WORD)
        # [words, lanes of a word]: contiguity is exactly one word, so the load cannot be
        # given a wider per-thread layout than the store (which would need a shuffle
        # through shared memory between them).
        words = tl.arange(0, LANES // (WORD // 4))
        lanes = words[:, None] * (WORD // 4) + tl.arange(0, WORD // 4)[None, :]
        mask = words[:, None] < n_words
        tl.store(dst_ptr + lanes, tl.load(src_ptr + lanes, mask=mask), mask=mask)
    else:
        src_ptr = src.to(tl.pointer_type(tl.uint8))
        dst_ptr = dst.to(tl.pointer_type(tl.uint8))
        start = n_words * 0
        while start < n_words:
            lanes = start + tl.arange(0, LANES)
            mask = lanes < n_words
            tl.store(dst_ptr + lanes, tl.load(src_ptr + lanes, mask=mask), mask=mask)
            start += LANES


@triton.jit(do_not_specialize=["pool_address", "pool_row_bytes", "num_groups", "direction"])
def _copy_blocks_kernel(
    tile_table_ptr,
    group_table_ptr,
    pairs_ptr,
    group_offsets_ptr,
    pool_address,
    pool_row_bytes,
    num_groups,
    direction,
    TILE_BYTES: tl.constexpr,
    NARROW_BYTES: tl.constexpr,
):
    """Copy every plane page named by the pair table, in the given direction.

    Args:
        tile_table_ptr: int64 ``[num_tiles, 5]``, static. One row per tile of a plane page,
            grouped by cache group, ordered by plane then offset: (device address of the
            tile in block 0 [bytes], block stride [bytes], byte offset of the tile in
            pool slot 0 of a row [bytes], page bytes (= slot stride in the row) [bytes],
            tile length [bytes, 1..TILE_BYTES]).
        group_table_ptr: int64 ``[num_groups, 2]``, static: (tiles per pair [count],
            first row of the group in the tile table [row index]).
        pairs_ptr: int64 ``[num_pairs, 3]``, per job: (GPU block id, pool row, slot),
            ordered by group.
        group_offsets_ptr: int64 ``[num_groups + 1]``, per job: pairs of group g are rows
            ``group_offsets[g]:group_offsets[g + 1]`` of the pair table.
        pool_address: int64 scalar, device-visible byte address of pool row 0.
        pool_row_bytes: int scalar, bytes between pool rows.
        num_groups: int scalar, number of cache groups (rows of group_table).
        direction: int scalar, 0 = planes -> pool (store), 1 = pool -> planes (load).
        TILE_BYTES: constexpr, most bytes of one item; the tile table was cut with it.
        NARROW_BYTES: constexpr, lanes of the byte path.
    """
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    # Items of all groups form one sequence; program `pid` owns items pid, pid + P, ...
    # `item_base` is the index of the current group's first item in that sequence.
    item_base = pid * 0
    group = pid * 0
    while group < num_groups:
        pair_lo = tl.load(group_offsets_ptr + group)
        pair_hi = tl.load(group_offsets_ptr + group + 1)
        tiles_per_pair = tl.load(group_table_ptr + group * 2)
        tile_row0 = tl.load(group_table_ptr + group * 2 + 1)
        num_items = (pair_hi - pair_lo) * tiles_per_pair
        item = (pid - item_base % num_programs + num_programs) % num_programs
        while item < num_items:
            pair_in_group = item // tiles_per_pair
            tile_row = tile_row0 + (item - pair_in_group * tiles_per_pair)
            pair = pair_lo + pair_in_group
            gpu_block = tl.load(pairs_ptr + pair * 3)
            pool_row = tl.load(pairs_ptr + pair * 3 + 1)
            slot = tl.load(pairs_ptr + pair * 3 + 2)
            tile = tile_table_ptr + tile_row * 5
            block0_address = tl.load(tile)
            block_stride = tl.load(tile + 1)
            pool_tile_offset = tl.load(tile + 2)
            page_bytes = tl.load(tile + 3)
            num_bytes = tl.load(tile + 4)
            cache_address = block0_address + gpu_block * block_stride
            pool_page_address = (
                pool_address + pool_row * pool_row_bytes + pool_tile_offset + slot * page_bytes
            )
            to_pool = direction == 0
            src = tl.where(to_pool, cache_address, pool_page_address)
            dst = tl.where(to_pool, pool_page_address, cache_address)
            alignment = src | dst
            if (alignment & 15) == 0:
                _copy_words(src, dst, num_bytes // 16, 16, TILE_BYTES // 4)
                done = (num_bytes // 16) * 16
            elif (alignment & 7) == 0:
                _copy_words(src, dst, num_bytes // 8, 8, TILE_BYTES // 4)
                done = (num_bytes // 8) * 8
            elif (alignment & 3) == 0:
                _copy_words(src, dst, num_bytes // 4, 4, TILE_BYTES // 4)
                done = (num_bytes // 4) * 4
            else:
                done = num_bytes * 0
            # Tail shorter than one word, or the whole item when the addresses are odd.
            _copy_words(src + done, dst + done, num_bytes - done, 1, NARROW_BYTES)
            item += num_programs
        item_base += num_items
        group += 1


def default_num_programs(
    device: torch.device | str | int, mean_tile_bytes: int = TILE_BYTES
) -> int:
    """Persistent-grid size: enough bytes in flight for PCIe, capped at the SM count.

    ``ceil(PCIE_IN_FLIGHT_TARGET_BYTES / mean_tile_bytes)`` programs (32 for full 8 KiB
    tiles; see the constant for the reasoning), at most one per SM. ``mean_tile_bytes``
    is the tables' mean item size (``CopyTables.mean_tile_bytes``): small pages leave
    each program fewer bytes in flight, so they get more programs. Under the interpreter
    (CPU tensors) a small grid keeps tests fast.
    """
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if _INTERPRETED or device.type != "cuda":
        return INTERPRETER_NUM_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return grid_size(_sm_count(index), mean_tile_bytes)


def grid_size(sm_count: int, mean_tile_bytes: int) -> int:
    """The launch setting itself, a pure function: see ``PCIE_IN_FLIGHT_TARGET_BYTES``."""
    wanted = -(-PCIE_IN_FLIGHT_TARGET_BYTES // max(1, min(int(mean_tile_bytes), TILE_BYTES)))
    return max(1, min(sm_count, wanted))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def launch_copy(
    layout: CopyTables,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    pool_address: int,
    direction: int,
    *,
    num_programs: int | None = None,
) -> None:
    """Enqueue ONE launch copying the job on the current stream; no checks, no host sync.

    ``layout`` holds the static tables. ``pairs`` (int64 ``[n, 3]``, contiguous) and
    ``group_offsets`` (int64 ``[num_groups + 1]``) must already be on ``layout.device``
    and valid (the caller validated them). ``pool_address`` is the device-visible address
    of pool row 0; ``direction`` 0 stores (planes -> pool), 1 loads.
    """
    if pairs.shape[0] == 0:
        return
    if num_programs is None:
        num_programs = default_num_programs(layout.device, layout.mean_tile_bytes)
    _copy_blocks_kernel[(num_programs,)](
        layout.tile_table,
        layout.group_table,
        pairs,
        group_offsets,
        pool_address,
        layout.pool_row_bytes,
        layout.num_groups,
        int(direction),
        TILE_BYTES=TILE_BYTES,
        NARROW_BYTES=NARROW_BYTES,
        num_warps=NUM_WARPS,
    )


# triton.jit returns an interpreted function when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_copy_blocks_kernel, triton.runtime.JITFunction)
