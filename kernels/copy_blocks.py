"""Gather/scatter of KV-cache pages between cache planes and pool rows: one launch per job.

A *plane* is one contiguous per-block region of a cache tensor: ``(base address, block
stride, page bytes)``. A K/V FlashAttention tensor ``(2, num_blocks, ...)`` is two planes,
a Mamba layer one plane per state tensor, so page sizes differ inside one job (e.g. two
4 KiB attention planes, a 1,536-byte conv plane and a 64 KiB SSM plane).

The *pool* is a 2-D byte array of ``pool_rows`` rows of ``pool_row_bytes`` each (pinned
host memory in real use, device or CPU memory in tests). A row holds one chunk of one
group, plane-major: slot ``s`` of plane ``p`` sits at
``row * pool_row_bytes + pool_offset_p + s * page_bytes_p``.

Static geometry (:class:`CopyLayout`) is validated and uploaded once per cache
registration. Per job only the pair table travels: ``pairs[n, 3]`` int64 rows
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

import enum
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = [
    "NARROW_BYTES",
    "NUM_WARPS",
    "TILE_BYTES",
    "CopyLayout",
    "Direction",
    "PlaneGeometry",
    "copy_blocks",
    "default_num_programs",
    "grid_size",
    "launch_copy",
    "validate_pairs",
]

# Bytes one program copies per item: 512 lanes of 16 bytes, i.e. four 16-byte loads in
# flight per thread at NUM_WARPS=4 (16 data registers per thread). Larger tiles only cost
# registers; smaller ones multiply the per-item scalar work (eight table loads, address
# arithmetic).
TILE_BYTES = 8192
# Lanes of the byte path (misaligned items and tails shorter than one word). 512 saves
# 8 registers on Triton 3.6 / sm_90, but then its ptxas moves the next item's tile length
# into a uniform register right after the load (seen in the SASS), i.e. waits for that
# load before the current item's stores.
NARROW_BYTES = 1024
NUM_WARPS = 4
# Options of every launch, shared by launch_copy and warm_up so that the kernel warm_up
# compiles is the one jobs run.
_LAUNCH_OPTIONS: dict[str, int] = {
    "TILE_BYTES": TILE_BYTES,
    "NARROW_BYTES": NARROW_BYTES,
    "num_warps": NUM_WARPS,
}

# Bytes that must be in flight to keep PCIe Gen5 x16 busy: ~55 GB/s x ~2 us host-read
# round trip ~= 110 KB. Each program keeps one item's data (one tile, at most
# TILE_BYTES) in flight, plus the next item's table rows, so we ask for about twice
# that: with full 8 KiB tiles, 256 KiB / 8 KiB = 32 programs; with smaller pages more
# (mean tile of 2 KiB: 128 programs; 1 KiB: 256), up to MAX_PROGRAMS_PER_SM per SM. 32
# of an H100's 132 SMs leaves the rest to the forward pass that runs concurrently on
# the compute stream. Not tuned on a GPU yet: the bench sweep of num_programs is the
# measurement that should replace this estimate.
PCIE_IN_FLIGHT_TARGET_BYTES = 256 * 1024
# Programs one SM may hold for small mean tiles. One per SM capped the grid at 132 on an
# H100, i.e. ~132 KiB in flight at 1 KiB tiles and ~66 KiB at 512 B, below the ~110 KB
# PCIe needs. Two per SM reach 264 programs (1 KiB tiles: the full 256 KiB; 512 B tiles:
# 135 KB) while each SM keeps most of its resources for the forward pass: a program is
# 4 warps of ~72 registers per thread (ptxas, Triton 3.6), so two take 8 of 64 warp
# slots and ~18 K of 64 K registers, whereas four would take over half the register
# file, enough to keep a 256-thread, 128-register GEMM block off the SM.
MAX_PROGRAMS_PER_SM = 2
# The interpreter runs programs one after another; a few programs still exercise the
# grid-stride walk (items owned by several programs, group boundaries mid-stride).
INTERPRETER_NUM_PROGRAMS = 4

_INT64_MAX = (1 << 63) - 1


class Direction(enum.IntEnum):
    """Which way a launch copies. A device-resident pool makes it a device -> device copy."""

    TO_POOL = 0  # store: cache planes -> pool rows
    FROM_POOL = 1  # load: pool rows -> cache planes


@triton.jit
def _wide_lanes(n_words, LANES: tl.constexpr):
    """Int32 lane offsets and mask of ``LANES`` 16-byte words, ``n_words`` of them live.

    ``[words, 4 lanes of a word]``: contiguity is exactly one word, so the load cannot be
    given a wider per-thread layout than the store (which would need a shuffle through
    shared memory between them), and the mask is constant over each word, so it does not
    split the vector.
    """
    words = tl.arange(0, LANES)
    lanes = words[:, None] * 4 + tl.arange(0, 4)[None, :]
    return lanes, words[:, None] < n_words


@triton.jit
def _copy_words(src, dst, n_words, WORD: tl.constexpr, LANES: tl.constexpr):
    """Copy ``n_words`` words of ``WORD`` (1, 4 or 8) bytes, ``LANES`` words per step.

    ``src``/``dst`` are WORD-aligned int64 addresses. Words of 8 bytes move as 2
    contiguous int32 lanes (``v2.b32``); a pointer made from an integer carries no
    alignment, hence the ``tl.multiple_of``. The step keeps every thread at four accesses
    in flight, as on the 16-byte path: a whole tile of 4-byte words per step would hold
    16 addresses per thread, and the kernel's register count is set by its widest point.

    Page bytes are read once and written once, so every access is marked evict-first
    (``L1::evict_first`` plus an ``L2::evict_first`` cache policy): a job must not push
    the forward pass's weights and activations out of L1/L2. ``eviction_policy`` is the
    hint both Triton 3.6 and newer accept on loads and stores alike (3.6 rejects ``.cs``
    on loads, and ptxas refuses ``.cg``/``.cs`` combined with an eviction priority).
    """
    if WORD >= 4:
        words = tl.arange(0, LANES)
        lanes = words[:, None] * (WORD // 4) + tl.arange(0, WORD // 4)[None, :]
        start = n_words * 0
        while start < n_words:
            src_ptr = tl.multiple_of((src + start * WORD).to(tl.pointer_type(tl.int32)), WORD)
            dst_ptr = tl.multiple_of((dst + start * WORD).to(tl.pointer_type(tl.int32)), WORD)
            mask = words[:, None] < n_words - start
            data = tl.load(src_ptr + lanes, mask=mask, eviction_policy="evict_first")
            tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
            start += LANES
    else:
        src_ptr = src.to(tl.pointer_type(tl.uint8))
        dst_ptr = dst.to(tl.pointer_type(tl.uint8))
        start = n_words * 0
        while start < n_words:
            lanes = start + tl.arange(0, LANES)
            mask = lanes < n_words
            data = tl.load(src_ptr + lanes, mask=mask, eviction_policy="evict_first")
            tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
            start += LANES


@triton.jit
def _item_rows(pairs_ptr, tile_table_ptr, pair, tile_row, valid):
    """The pair row and tile row of one item: eight scalar int64 loads, cached (tables are
    re-read by every job). Masked by ``valid``: a program's look-ahead past its last item
    must not read past the pair table (a job's table ends at its last pair)."""
    pair_row = pairs_ptr + pair * 3
    tile = tile_table_ptr + tile_row * 5
    return (
        tl.load(pair_row, mask=valid, other=0),  # GPU block id
        tl.load(pair_row + 1, mask=valid, other=0),  # pool row
        tl.load(pair_row + 2, mask=valid, other=0),  # slot
        tl.load(tile, mask=valid, other=0),  # tile address in block 0
        tl.load(tile + 1, mask=valid, other=0),  # block stride
        tl.load(tile + 2, mask=valid, other=0),  # tile offset in pool slot 0
        tl.load(tile + 3, mask=valid, other=0),  # page bytes (slot stride)
        tl.load(tile + 4, mask=valid, other=0),  # tile length
    )


# Every runtime argument is left unspecialized, so ONE compiled kernel serves every job:
# by default Triton specializes a tensor argument on 16-byte alignment and an int on
# ``== 1`` / divisibility by 16. Per-job tables are often slices (``pairs[3n:]`` is
# 16-byte aligned only for even n) and a recompile mid-serving costs ~1 s. The int
# arguments carry annotations so their types do not follow their values either (an
# unannotated int is i32 below 2**31 and i64 above). Nothing is lost: the kernel reads
# the tables with scalar int64 loads, whose alignment the element type already implies.
@triton.jit(
    do_not_specialize=[
        "tile_table_ptr",
        "group_table_ptr",
        "pairs_ptr",
        "group_offsets_ptr",
        "pool_address",
        "pool_row_bytes",
        "num_groups",
        "direction",
    ]
)
def _copy_blocks_kernel(
    tile_table_ptr,
    group_table_ptr,
    pairs_ptr,
    group_offsets_ptr,
    pool_address: tl.int64,
    pool_row_bytes: tl.int64,
    num_groups: tl.int32,
    direction: tl.int32,
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
        pool_row_bytes: int64 scalar, bytes between pool rows.
        num_groups: int32 scalar, number of cache groups (rows of group_table).
        direction: int32 scalar, 0 = planes -> pool (store), 1 = pool -> planes (load).
        TILE_BYTES: constexpr, most bytes of one item; the tile table was cut with it.
        NARROW_BYTES: constexpr, lanes of the byte path.

    Each program keeps two items in flight: the table rows of its next item (eight
    scalar loads) are issued while the current item's 16-byte data loads are outstanding
    and before its stores (on the narrower paths: before its copy), so the table latency
    hides behind the data's instead of being paid once more per item.
    """
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    to_pool = direction == 0
    # Items of all groups form one sequence; program `pid` owns items pid, pid + P, ...
    # `item_base` is the index of the current group's first item in that sequence.
    item_base = pid * 0
    group = num_groups * 0
    while group < num_groups:
        pair_lo = tl.load(group_offsets_ptr + group)
        pair_hi = tl.load(group_offsets_ptr + group + 1)
        tiles_per_pair = tl.load(group_table_ptr + group * 2)
        tile_row0 = tl.load(group_table_ptr + group * 2 + 1)
        num_items = (pair_hi - pair_lo) * tiles_per_pair
        item = (pid - item_base % num_programs + num_programs) % num_programs
        # An item is (pair, tile of the pair). The grid stride P moves it by
        # (P // tiles_per_pair) pairs and (P % tiles_per_pair) tiles with one carry, so
        # the int64 divisions run once per group, not once per item. The max() only
        # keeps a group without planes (no items) from dividing by zero.
        divisor = tl.maximum(tiles_per_pair, 1)
        pair = pair_lo + item // divisor
        tile_in_pair = item % divisor
        pair_step = num_programs // divisor
        tile_step = num_programs % divisor
        rows = _item_rows(
            pairs_ptr, tile_table_ptr, pair, tile_row0 + tile_in_pair, item < num_items
        )
        while item < num_items:
            (
                gpu_block,
                pool_row,
                slot,
                block0_address,
                block_stride,
                pool_tile_offset,
                page_bytes,
                item_bytes,
            ) = rows
            cache_address = block0_address + gpu_block * block_stride
            pool_page_address = (
                pool_address + pool_row * pool_row_bytes + pool_tile_offset + slot * page_bytes
            )
            src = tl.where(to_pool, cache_address, pool_page_address)
            dst = tl.where(to_pool, pool_page_address, cache_address)
            # Position of the next item.
            item += num_programs
            tile_in_pair += tile_step
            carry = tile_in_pair >= tiles_per_pair
            tile_in_pair = tl.where(carry, tile_in_pair - tiles_per_pair, tile_in_pair)
            pair += tl.where(carry, pair_step + 1, pair_step)
            next_row = tile_row0 + tile_in_pair
            valid = item < num_items
            alignment = src | dst
            if (alignment & 15) == 0:
                # The common path, one step: an item is at most TILE_BYTES = LANES words.
                # The next item's rows are loaded between this item's loads and stores.
                lanes, mask = _wide_lanes(item_bytes // 16, TILE_BYTES // 16)
                src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
                dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
                data = tl.load(src_ptr + lanes, mask=mask, eviction_policy="evict_first")
                rows = _item_rows(pairs_ptr, tile_table_ptr, pair, next_row, valid)
                tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
                done = (item_bytes // 16) * 16
            else:
                rows = _item_rows(pairs_ptr, tile_table_ptr, pair, next_row, valid)
                if (alignment & 7) == 0:
                    _copy_words(src, dst, item_bytes // 8, 8, TILE_BYTES // 16)
                    done = (item_bytes // 8) * 8
                elif (alignment & 3) == 0:
                    _copy_words(src, dst, item_bytes // 4, 4, TILE_BYTES // 16)
                    done = (item_bytes // 4) * 4
                else:
                    done = item_bytes * 0
            # Tail shorter than one word, or the whole item when the addresses are odd.
            _copy_words(src + done, dst + done, item_bytes - done, 1, NARROW_BYTES)
        item_base += num_items
        group += 1


@dataclass(frozen=True)
class PlaneGeometry:
    """Static geometry of one cache plane and of its slots in a pool row.

    All sizes in bytes. ``base_address`` is the device-visible address of block 0
    (``tensor.data_ptr()``); block ``b`` starts at ``base_address + b * block_stride`` and
    its first ``page_bytes`` bytes are copied. Slot ``s`` of this plane in a pool row
    starts ``pool_offset + s * page_bytes`` bytes into the row.
    """

    group: int
    base_address: int
    block_stride: int
    page_bytes: int
    num_blocks: int
    pool_offset: int

    @classmethod
    def of_view(cls, view: torch.Tensor, *, group: int, pool_offset: int) -> PlaneGeometry:
        """Geometry of a uint8 ``[num_blocks, page_bytes]`` view with a contiguous last dim.

        Raises ValueError when the page does not fit the tensor (non-contiguous page, a
        block stride smaller than the page, so that blocks would overlap).
        """
        if not isinstance(view, torch.Tensor):
            raise TypeError(f"plane view must be a torch.Tensor, got {type(view).__name__}")
        if view.dtype != torch.uint8 or view.dim() != 2:
            raise ValueError(
                f"plane view must be uint8 [num_blocks, page_bytes], got {view.dtype} "
                f"{tuple(view.shape)}"
            )
        num_blocks, page_bytes = view.shape
        if page_bytes > 1 and view.stride(1) != 1:
            raise ValueError(f"plane view page is not contiguous: stride {view.stride()}")
        if num_blocks > 1 and view.stride(0) < page_bytes:
            raise ValueError(
                f"plane view block stride {view.stride(0)} bytes is smaller than its page "
                f"of {page_bytes} bytes: blocks would overlap"
            )
        stride = view.stride(0) if num_blocks > 1 else max(view.stride(0), page_bytes)
        return cls(
            group=group,
            base_address=view.data_ptr(),
            block_stride=stride,
            page_bytes=page_bytes,
            num_blocks=num_blocks,
            pool_offset=pool_offset,
        )


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} {value} must be >= {minimum}")
    return int(value)


def _planes_overlap(a: PlaneGeometry, b: PlaneGeometry) -> bool:
    """Whether some page of plane ``a`` shares a byte with some page of plane ``b``."""
    a_end = a.base_address + (a.num_blocks - 1) * a.block_stride + a.page_bytes
    b_end = b.base_address + (b.num_blocks - 1) * b.block_stride + b.page_bytes
    if a_end <= b.base_address or b_end <= a.base_address:
        return False
    if a.block_stride != b.block_stride or a.num_blocks == 1 or b.num_blocks == 1:
        return True  # conservative: interleaved planes of different strides count as aliasing
    # Equal strides: pages repeat with the same period; compare one period.
    shift = (b.base_address - a.base_address) % a.block_stride
    return shift < a.page_bytes or shift > a.block_stride - b.page_bytes


@dataclass(frozen=True, eq=False)
class CopyLayout:
    """Validated static geometry of one cache registration, with its device tables.

    Build with :meth:`CopyLayout.build`. ``tile_table`` / ``group_table`` live on
    ``device`` and are read by every launch; ``group_num_blocks`` and the group pairs
    that alias cache bytes (``cache_alias_groups``) or share pool-row bytes
    (``pool_shared_groups``) stay on the host for :func:`validate_pairs`.
    ``mean_tile_bytes`` (mean item size) sizes the default grid. The layout stores
    addresses only: the caller keeps the cache tensors alive while the layout is used.
    """

    planes: tuple[PlaneGeometry, ...]
    num_groups: int
    blocks_per_chunk: int
    pool_row_bytes: int
    pool_rows: int
    device: torch.device
    mean_tile_bytes: int
    tile_table: torch.Tensor
    group_table: torch.Tensor
    group_num_blocks: np.ndarray
    cache_alias_groups: tuple[tuple[int, int], ...]
    pool_shared_groups: tuple[tuple[int, int], ...]

    @classmethod
    def build(
        cls,
        planes: Sequence[PlaneGeometry],
        *,
        num_groups: int,
        blocks_per_chunk: int,
        pool_row_bytes: int,
        pool_rows: int,
        device: torch.device | str,
    ) -> CopyLayout:
        """Validate ``planes`` (ordered by group) and upload the tile and group tables."""
        num_groups = _check_int("num_groups", num_groups, 1)
        blocks_per_chunk = _check_int("blocks_per_chunk", blocks_per_chunk, 1)
        pool_row_bytes = _check_int("pool_row_bytes", pool_row_bytes, 1)
        pool_rows = _check_int("pool_rows", pool_rows, 1)
        if pool_rows * pool_row_bytes > _INT64_MAX:
            raise ValueError(f"pool of {pool_rows} rows x {pool_row_bytes} bytes overflows int64")
        planes = tuple(planes)
        previous_group = 0
        for index, plane in enumerate(planes):
            if not isinstance(plane, PlaneGeometry):
                raise TypeError(f"plane {index} must be a PlaneGeometry, got {plane!r}")
            what = f"plane {index}"
            group = _check_int(f"{what} group", plane.group, 0)
            if group >= num_groups:
                raise ValueError(f"{what} group {group} out of range [0, {num_groups})")
            if group < previous_group:
                raise ValueError(
                    f"{what} group {group} follows group {previous_group}: planes must be "
                    "ordered by group"
                )
            previous_group = group
            _check_int(f"{what} base_address", plane.base_address, 1)
            page = _check_int(f"{what} page_bytes", plane.page_bytes, 1)
            num_blocks = _check_int(f"{what} num_blocks", plane.num_blocks, 1)
            stride = _check_int(f"{what} block_stride", plane.block_stride, 1)
            offset = _check_int(f"{what} pool_offset", plane.pool_offset, 0)
            if num_blocks > 1 and stride < page:
                raise ValueError(
                    f"{what} block_stride {stride} is smaller than page_bytes {page}: "
                    "blocks would overlap"
                )
            if plane.base_address + (num_blocks - 1) * stride + page > _INT64_MAX:
                raise ValueError(f"{what} address range overflows int64")
            if offset + blocks_per_chunk * page > pool_row_bytes:
                raise ValueError(
                    f"{what} pool_offset {offset} + {blocks_per_chunk} slots x {page} bytes "
                    f"exceeds pool_row_bytes {pool_row_bytes}"
                )
        # Planes of one group must not share bytes of a pool row (a store would clobber).
        for group in range(num_groups):
            members = sorted(
                (p.pool_offset, p.pool_offset + blocks_per_chunk * p.page_bytes, i)
                for i, p in enumerate(planes)
                if p.group == group
            )
            for (_, end, i), (start, _, j) in itertools.pairwise(members):
                if start < end:
                    raise ValueError(
                        f"plane {j} pool_offset {start} overlaps plane {i}'s slots "
                        f"(ending at byte {end}) in the rows of group {group}"
                    )

        tiles: list[tuple[int, int, int, int, int]] = []
        group_rows: list[tuple[int, int]] = []
        group_num_blocks = np.full(num_groups, _INT64_MAX, dtype=np.int64)
        for group in range(num_groups):
            first = len(tiles)
            for plane in planes:
                if plane.group != group:
                    continue
                group_num_blocks[group] = min(group_num_blocks[group], plane.num_blocks)
                for start in range(0, plane.page_bytes, TILE_BYTES):
                    tiles.append(
                        (
                            plane.base_address + start,
                            plane.block_stride,
                            plane.pool_offset + start,
                            plane.page_bytes,
                            min(TILE_BYTES, plane.page_bytes - start),
                        )
                    )
            group_rows.append((len(tiles) - first, first))
        group_num_blocks.setflags(write=False)
        device = torch.device(device)
        tile_table = torch.tensor(tiles, dtype=torch.int64).reshape(-1, 5).to(device)
        group_table = torch.tensor(group_rows, dtype=torch.int64).reshape(-1, 2).to(device)

        # Groups may alias the same cache memory (hybrid allocators share tensors across
        # groups); the same block id in two such groups names the same bytes.
        cache_alias: set[tuple[int, int]] = set()
        pool_shared: set[tuple[int, int]] = set()
        for i, a in enumerate(planes):
            for b in planes[i + 1 :]:
                if a.group == b.group:
                    continue
                pair = (min(a.group, b.group), max(a.group, b.group))
                if _planes_overlap(a, b):
                    cache_alias.add(pair)
                a_end = a.pool_offset + blocks_per_chunk * a.page_bytes
                b_end = b.pool_offset + blocks_per_chunk * b.page_bytes
                if a.pool_offset < b_end and b.pool_offset < a_end:
                    pool_shared.add(pair)
        return cls(
            planes=planes,
            num_groups=num_groups,
            blocks_per_chunk=blocks_per_chunk,
            pool_row_bytes=pool_row_bytes,
            pool_rows=pool_rows,
            device=device,
            mean_tile_bytes=(sum(t[4] for t in tiles) // len(tiles) if tiles else TILE_BYTES),
            tile_table=tile_table,
            group_table=group_table,
            group_num_blocks=group_num_blocks,
            cache_alias_groups=tuple(sorted(cache_alias)),
            pool_shared_groups=tuple(sorted(pool_shared)),
        )


def _host_int64(name: str, table: Any) -> np.ndarray:
    if isinstance(table, torch.Tensor):
        if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {table.dtype}")
        return table.detach().cpu().numpy().astype(np.int64, copy=False)
    array = np.asarray(table)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def _first_duplicate(
    major: np.ndarray, minor: np.ndarray, minor_limit: int
) -> tuple[int, int] | None:
    """Indices (earlier, later) of the first pair whose (major, minor) key repeats, or None.

    Keys are packed into one int64 (``minor`` is in ``[0, minor_limit)``) so that the
    common case, no repeat, costs one sort.
    """
    if int(major.max()) >= _INT64_MAX // max(minor_limit, 1):
        raise ValueError(f"ids too large to check for repeats: {int(major.max())}")
    keys = major * minor_limit + minor
    if not np.any(np.diff(np.sort(keys)) == 0):
        return None
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    seconds = order[repeated + 1]
    k = int(np.argmin(seconds))
    return int(order[repeated[k]]), int(seconds[k])


def validate_pairs(
    layout: CopyLayout, pairs: Any, group_offsets: Any, direction: Direction | int
) -> None:
    """Check a job's pair table on the host (vectorized); ValueError naming the bad value.

    ``pairs``: ``[n, 3]`` (gpu_block_id, pool_row, slot), ``group_offsets``:
    ``[num_groups + 1]``; CPU tensors or numpy arrays (device tensors are copied, which
    synchronises). Rejects negative or out-of-range ids, rows and slots, inconsistent
    group offsets, and two pairs of the job writing the same destination page.
    """
    try:
        direction = Direction(direction)
    except ValueError:
        raise ValueError(f"direction {direction!r} is not a Direction") from None
    table = _host_int64("pairs", pairs)
    offsets = _host_int64("group_offsets", group_offsets)
    if table.ndim != 2 or table.shape[1] != 3:
        raise ValueError(f"pairs must have shape [n, 3], got {tuple(table.shape)}")
    if offsets.shape != (layout.num_groups + 1,):
        raise ValueError(
            f"group_offsets must have shape [{layout.num_groups + 1}] (num_groups + 1), got "
            f"{tuple(offsets.shape)}"
        )
    num_pairs = table.shape[0]
    if offsets[0] != 0:
        raise ValueError(f"group_offsets[0] is {offsets[0]}, must be 0")
    steps = np.diff(offsets)
    if np.any(steps < 0):
        g = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"group_offsets decrease at group {g}: {offsets[g]} then {offsets[g + 1]}")
    if offsets[-1] != num_pairs:
        raise ValueError(
            f"group_offsets[-1] is {offsets[-1]} but pairs has {num_pairs} rows: table "
            "lengths do not match"
        )
    if num_pairs == 0:
        return
    groups = np.repeat(np.arange(layout.num_groups, dtype=np.int64), steps)
    names = ("GPU block id", "pool row", "slot")
    limits = (
        layout.group_num_blocks[groups],
        np.full(num_pairs, layout.pool_rows, dtype=np.int64),
        np.full(num_pairs, layout.blocks_per_chunk, dtype=np.int64),
    )
    for column, (name, limit) in enumerate(zip(names, limits, strict=True)):
        values = table[:, column]
        bad = np.flatnonzero((values < 0) | (values >= limit))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{name} {values[i]} at pair {i} (group {groups[i]}) out of range [0, {limit[i]})"
            )

    if direction == Direction.TO_POOL:
        # Destination page = (group, row, slot); groups whose planes share row bytes also
        # clash on the same row whatever the slot.
        bpc = layout.blocks_per_chunk
        clash = _first_duplicate(groups, table[:, 1] * bpc + table[:, 2], layout.pool_rows * bpc)
        if clash is not None:
            i, j = clash
            raise ValueError(
                f"pairs {i} and {j} both write pool row {table[j, 1]} slot {table[j, 2]} "
                f"(group {groups[j]})"
            )
        shared, column, what = layout.pool_shared_groups, 1, "pool row"
    else:
        clash = _first_duplicate(groups, table[:, 0], int(table[:, 0].max()) + 1)
        if clash is not None:
            i, j = clash
            raise ValueError(
                f"pairs {i} and {j} both write GPU block id {table[j, 0]} (group {groups[j]})"
            )
        shared, column, what = layout.cache_alias_groups, 0, "GPU block id"
    if not shared:
        return
    num_groups = layout.num_groups
    conflicts = np.zeros((num_groups, num_groups), dtype=bool)
    for g, h in shared:
        conflicts[g, h] = conflicts[h, g] = True
    ids = table[:, column]
    if int(ids.max()) >= _INT64_MAX // num_groups:
        raise ValueError(f"{what} {int(ids.max())} too large to check for clashes")
    # Distinct (id, group) keys in id order: each id has at most num_groups entries, so
    # comparing every entry with the next num_groups - 1 ones finds all same-id pairs.
    keys = np.sort(ids * num_groups + groups)
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    key_ids, key_groups = keys // num_groups, keys % num_groups
    for distance in range(1, num_groups):
        a, b = slice(None, -distance), slice(distance, None)
        hit = (key_ids[a] == key_ids[b]) & conflicts[key_groups[a], key_groups[b]]
        if np.any(hit):
            k = int(np.flatnonzero(hit)[0])
            g, h = int(key_groups[k]), int(key_groups[k + distance])
            raise ValueError(
                f"{what} {key_ids[k]} is written by groups {g} and {h}, whose planes share "
                "those bytes"
            )


def default_num_programs(
    device: torch.device | str | int, mean_tile_bytes: int = TILE_BYTES
) -> int:
    """Persistent-grid size: enough bytes in flight for PCIe, at most two programs per SM.

    ``ceil(PCIE_IN_FLIGHT_TARGET_BYTES / mean_tile_bytes)`` programs (32 for full 8 KiB
    tiles; see the constant for the reasoning), at most ``MAX_PROGRAMS_PER_SM`` per SM.
    ``mean_tile_bytes`` is the layout's mean item size (``CopyLayout.mean_tile_bytes``):
    small pages leave each program fewer bytes in flight, so they get more programs.
    Under the interpreter (CPU tensors) a small grid keeps tests fast.
    """
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if _INTERPRETED or device.type != "cuda":
        return INTERPRETER_NUM_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return grid_size(_sm_count(index), mean_tile_bytes)


def grid_size(sm_count: int, mean_tile_bytes: int) -> int:
    """The launch setting itself, a pure function: see ``PCIE_IN_FLIGHT_TARGET_BYTES`` and
    ``MAX_PROGRAMS_PER_SM``."""
    wanted = -(-PCIE_IN_FLIGHT_TARGET_BYTES // max(1, min(int(mean_tile_bytes), TILE_BYTES)))
    return max(1, min(MAX_PROGRAMS_PER_SM * sm_count, wanted))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _empty_job(device: torch.device) -> tuple[object, ...]:
    """Kernel arguments of a job with one group and no pairs, on ``device``.

    The kernel reads this group's four table words and moves no byte. Fresh tables, like
    a layout's; the values of the scalars do not matter (no argument is specialized).
    """
    return (
        torch.zeros((1, 5), dtype=torch.int64, device=device),
        torch.zeros((1, 2), dtype=torch.int64, device=device),
        torch.zeros((1, 3), dtype=torch.int64, device=device),
        torch.zeros(2, dtype=torch.int64, device=device),
        0,  # pool address
        0,  # pool row bytes
        1,  # groups
        0,  # direction: to the pool
    )


def warm_up(device: torch.device | str | int) -> None:
    """Compile and load the copy kernel on ``device`` now, so the first job does not wait.

    Launches an empty job (no byte moves) on the current stream of ``device``. No kernel
    argument is specialized on its value or alignment and the launch options are the
    ones :func:`launch_copy` uses, so the kernel compiled here is the one every later job
    runs: a first compile costs ~1 s, mid-serving. Does nothing on CPU devices and under
    the interpreter, where nothing is compiled.
    """
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if _INTERPRETED or device.type != "cuda":
        return
    with torch.cuda.device(device):
        _copy_blocks_kernel[(1,)](*_empty_job(device), **_LAUNCH_OPTIONS)


def launch_copy(
    layout: CopyLayout,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    pool_address: int,
    direction: Direction | int,
    *,
    num_programs: int | None = None,
) -> None:
    """Enqueue ONE launch copying the job on the current stream; no checks, no host sync.

    ``pairs`` (int64 ``[n, 3]``, contiguous) and ``group_offsets`` (int64
    ``[num_groups + 1]``) must already be on ``layout.device`` and valid
    (:func:`validate_pairs`). ``pool_address`` is the device-visible address of pool row 0.
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
        **_LAUNCH_OPTIONS,
    )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        index_a = a.index if a.index is not None else torch.cuda.current_device()
        index_b = b.index if b.index is not None else torch.cuda.current_device()
        return index_a == index_b
    return True


def copy_blocks(
    layout: CopyLayout,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    pool: torch.Tensor,
    direction: Direction | int,
    *,
    num_programs: int | None = None,
) -> None:
    """Validate a job and launch it: the checked entry point (tests, one-off copies).

    ``pool`` must be a contiguous tensor on ``layout.device`` holding at least
    ``pool_rows * pool_row_bytes`` bytes. Raises ValueError/TypeError before any byte moves.
    """
    validate_pairs(layout, pairs, group_offsets, direction)
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if not _same_device(pool.device, layout.device):
        raise ValueError(f"pool is on {pool.device}, the layout on {layout.device}")
    if not pool.is_contiguous():
        raise ValueError(f"pool must be contiguous, got strides {pool.stride()}")
    pool_bytes = pool.numel() * pool.element_size()
    needed = layout.pool_rows * layout.pool_row_bytes
    if pool_bytes < needed:
        raise ValueError(
            f"pool holds {pool_bytes} bytes, the layout needs {layout.pool_rows} rows x "
            f"{layout.pool_row_bytes} bytes = {needed}"
        )
    if layout.device.type == "cpu" and not _INTERPRETED:
        raise ValueError(
            "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before import); "
            "use triton_offload.reference.reference_copy instead"
        )
    if num_programs is not None:
        num_programs = _check_int("num_programs", num_programs, 1)
    table = torch.as_tensor(pairs).to(device=layout.device, dtype=torch.int64).contiguous()
    offsets = torch.as_tensor(group_offsets).to(device=layout.device, dtype=torch.int64)
    launch_copy(
        layout,
        table,
        offsets.contiguous(),
        pool.data_ptr(),
        Direction(direction),
        num_programs=num_programs,
    )


# triton.jit returns an interpreted function when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_copy_blocks_kernel, triton.runtime.JITFunction)
