"""Gather/scatter of KV-cache pages between cache planes and pool rows: one launch per job.

A *plane* is one contiguous per-block region of a cache tensor: ``(base address, block
stride, page bytes)``. A K/V FlashAttention tensor ``(2, num_blocks, ...)`` is two planes,
a Mamba layer one plane per state tensor, so page sizes differ inside one job (e.g. two
4 KiB attention planes, a 1,536-byte conv plane and a 64 KiB SSM plane).

The *pool* is a 2-D byte array of rows ``pool_row_bytes`` apart (the row stride, which
may exceed what a row holds; pinned host memory in real use, device or CPU memory in
tests). A row holds one chunk of one group, plane-major: slot ``s`` of plane ``p`` sits
at ``row * pool_row_bytes + pool_offset_p + s * slot_stride_p`` (``slot_stride_p`` is
the page size, or larger for a fragment plane whose slots interleave with others').

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

Page checksums (optional, ``launch_copy(page_sums=..., pair_pages=...)``): a *page* is
one pool row, and its checksum ``wsum64`` is the sum over its little-endian 32-bit words
``w_j`` (bytes ``4j..4j+3`` of the row) of ``w_j * h(j)`` mod 2**64, with
``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32``; byte by byte, the byte of value ``b`` at
row offset ``o`` adds ``b * 2**(8 * (o % 4)) * h(o // 4)``. The sum is linear and
order-free, so every item adds the contribution of the bytes it moves with one atomic
add, in any order, and bytes no item moves count as zero. The kernel computes it on the
bytes it already holds in registers for the copy (no extra PCIe or HBM traffic), and a
``write=False`` launch computes it without storing anything (a checksum of either side
alone: the GPU blocks beside a DMA copy, or pool slots a job does not move).

Keyed page sums (``launch_copy(..., page_weights=...)``): ``keyed_wsum64`` is the same
sum with ``h(j)`` replaced by ``r_j``, word ``j``'s entry of a secret table of uint64
weights (``page_weights``, int64 bits, one per word of the longest page; built from a
seal key by :mod:`triton_offload.transfer.seal_key`): ``sum_j w_j * r_j mod 2**64``.
Every page reads the same table; a weight is loaded only for a word the item moves.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_PROGRAMS_PER_SM",
    "NARROW_BYTES",
    "NUM_WARPS",
    "TILE_BYTES",
    "TILE_COLUMNS",
    "WSUM_MULTIPLIER",
    "CopyTables",
    "default_num_programs",
    "grid_size",
    "launch_copy",
    "warm_up",
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


def _launch_options(
    tile_bytes: int, *, checksum: bool = False, write: bool = True, keyed: bool = False
) -> dict[str, int | bool]:
    """Options of a launch whose tables were cut at ``tile_bytes``: shared by launch_copy
    and warm_up, so that the kernel warm_up compiles is the one jobs run. The tile size
    travels with the tables (``CopyTables.tile_bytes``): a kernel compiled for 8 KiB
    lanes copies only the first 8 KiB of a 16 KiB item (the grid sweep's check once found
    32,628 of 205,280 pool bytes wrong that way at 16 KiB tiles). ``checksum``/``write``
    pick the kernel's CHECKSUM/WRITE variant, ``keyed`` (with ``checksum``) its KEYED
    one; a plain copy passes none, and an unkeyed checksum no KEYED, so each binds exactly
    as the kernel did before the later options existed."""
    assert checksum or not keyed, "keyed is a kind of checksum"
    options: dict[str, int | bool] = {
        "TILE_BYTES": tile_bytes,
        "NARROW_BYTES": NARROW_BYTES,
        "num_warps": NUM_WARPS,
    }
    if checksum or not write:
        options.update(CHECKSUM=checksum, WRITE=write)
    if keyed:
        options.update(KEYED=True)
    return options


# Bytes that must be in flight to keep PCIe Gen5 x16 busy: ~55 GB/s x ~2 us host-read
# round trip ~= 110 KB. Each program keeps one item's data (one tile, at most
# TILE_BYTES) in flight, plus the next item's table rows, so we ask for about twice
# that: with full 8 KiB tiles, 256 KiB / 8 KiB = 32 programs; with smaller pages more
# (mean tile of 2 KiB: 128 programs; 1 KiB: 256), up to MAX_PROGRAMS_PER_SM per SM. 32
# of an H100's 132 SMs leaves the rest to the forward pass that runs concurrently on
# the compute stream. Not tuned on a GPU yet: bench/grid_sweep.py (a step of
# bench/gpu_check.sh) sweeps num_programs x tile size on the hybrid presets and prints
# the grid it would pick; its result should replace this estimate.
PCIE_IN_FLIGHT_TARGET_BYTES = 256 * 1024
# Programs one SM may hold for small mean tiles. One per SM capped the grid at 132 on an
# H100, i.e. ~132 KiB in flight at 1 KiB tiles and ~66 KiB at 512 B, below the ~110 KB
# PCIe needs. Two per SM reach 264 programs (1 KiB tiles: the full 256 KiB; 512 B tiles:
# 135 KB) while each SM keeps most of its resources for the forward pass. The budget:
# two programs (8 of 64 warp slots) hold at most half of the 64 K-register file, so a
# 256-thread, 128-register GEMM block still fits beside them. Registers per thread, from
# `python -m triton_offload.bench.kernel_resources --target sm_90` (Triton 3.9, no spills;
# in brackets the registers two programs hold: sm_90 allocates per warp in units of 256,
# i.e. per thread rounded up to a multiple of 8, x 128 threads x 2 programs):
#
#   tile     plain       checksum     read-only    keyed        keyed read-only
#   4 KiB    64 (16 K)   80 (20 K)    72 (18 K)    112 (28 K)   80 (20 K)
#   8 KiB    71 (18 K)   80 (20 K)    80 (20 K)    128 (32 K)   96 (24 K)   <- TILE_BYTES
#   16 KiB   93 (24 K)   128 (32 K)   122 (32 K)   168 (42 K)   164 (42 K)
#
# (The keyed columns: ``ptxas -v`` on the PTX of the keyed variants as warm_up binds
# them, tests/kernels/test_copy_blocks_ptx.py's compile; kernel_resources does not list
# them.) Every unkeyed variant at the default tile keeps under a third of the file. The
# keyed copy holds each lane's 64-bit weight beside its data word (16 data + 32 weight
# registers on the 16-byte path) and takes the half-file budget exactly at the default
# tile; its read-only pass 3/8. At 16 KiB tiles (a grid-sweep point only) both unkeyed
# checksum variants take the half-file budget exactly (122 rounds up to 128) and the keyed
# ones exceed it: a grid that picks 16 KiB must be judged with checksums off, and four
# programs per SM would break the budget at any tile.
MAX_PROGRAMS_PER_SM = 2
# The interpreter runs programs one after another; a few programs still exercise the
# grid-stride walk (items owned by several programs, group boundaries mid-stride).
INTERPRETER_NUM_PROGRAMS = 4

#: Columns of a tile-table row (see the kernel's docstring).
TILE_COLUMNS = 5
#: Odd multiplier of the page checksum's word weights ``h(j) = (2j + 1) * WSUM_MULTIPLIER
#: mod 2**32`` (2**32 / golden ratio, Knuth's multiplicative hash). Every weight is odd,
#: so a change confined to one word (by d, 0 < |d| < 2**32) moves the sum by d * h(j),
#: never 0 mod 2**64; the weights of a page (under 8 GiB) all differ, so swapping two
#: different words moves it by (w_i - w_j) * (h_j - h_i), nonzero and below 2**64 in size.
#: The kernel spells it as a literal (Triton reads only constexpr globals).
WSUM_MULTIPLIER = 0x9E3779B1


class CopyTables(Protocol):
    """The static device tables and sizes one launch reads (built once by the caller).

    ``tile_table``: int64 ``[num_tiles, TILE_COLUMNS]`` and ``group_table``: int64
    ``[num_groups, 2]`` on ``device``, as the kernel's docstring describes (tiles cut at
    ``tile_bytes``, a power of two >= 16; ``TILE_BYTES`` by default); ``pool_row_bytes``:
    bytes between pool rows (the row stride); ``mean_tile_bytes``: mean item size, which
    sizes the default grid.
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
    def tile_bytes(self) -> int: ...
    @property
    def device(self) -> torch.device: ...


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
def _word_sums(data, weight):
    """Page-sum contributions (uint64, wrapping) of int32 words ``data``: ``w * weight``,
    ``weight`` (uint64, same shape) the words' weights."""
    return data.to(tl.uint32, bitcast=True).to(tl.uint64) * weight


@triton.jit
def _hash_weights(word_index):
    """``h(j)`` (uint64) of page word indices ``word_index`` (uint32; only ``j mod 2**31``
    matters): below 2**32, so ``w * h(j)`` is one 32x32->64-bit product per word."""
    return ((word_index * 2 + 1) * 0x9E3779B1).to(tl.uint64)  # WSUM_MULTIPLIER, wraps


@triton.jit
def _keyed_weights(weights_ptr, words, mask):
    """``r_j`` (uint64 bits of the int64 table) of the words ``weights_ptr + words``.

    Masked lanes load nothing and weigh 0: a lane past an item's last byte may name a
    word past the table's end. No eviction hint: every page re-reads the same table, so
    it should stay cached (the page data beside it is marked evict-first)."""
    return tl.load(weights_ptr + words, mask=mask, other=0).to(tl.uint64, bitcast=True)


@triton.jit
def _lane_sums(data, first_offset, lanes, mask, page_weights_ptr, KEYED: tl.constexpr):
    """Page-sum contribution (uint64 scalar) of int32 lanes ``data`` ``[words, k]``: lane
    ``lanes[w, i]`` (int32) sits at page offset ``first_offset + 4 * lanes[w, i]`` (int64
    ``first_offset``, a multiple of 4); ``mask`` (broadcast to ``lanes``) marks the live
    ones (dead lanes hold 0). ``KEYED``: weights ``r_j`` from ``page_weights_ptr``, else
    ``h(j)``."""
    first_word = first_offset >> 2
    if KEYED:
        # No alignment hint on the table: the word paths need only a 4-byte aligned page
        # offset, so the first word may be odd whatever the data addresses' alignment.
        weight = _keyed_weights(page_weights_ptr + first_word, lanes, mask)
    else:
        weight = _hash_weights(first_word.to(tl.uint32) + lanes.to(tl.uint32))
    return tl.sum(tl.sum(_word_sums(data, weight), 1), 0)


@triton.jit
def _byte_words(data, page_offset):
    """uint8 bytes ``data`` at page offsets ``page_offset`` (uint32, same shape) as int32
    words holding each byte where it sits in its page word: ``b * 2**(8 * (o % 4))``, to
    be weighed by the word's weight (of word ``o // 4``)."""
    shifted = data.to(tl.uint32) << ((page_offset & 3) * 8)
    return shifted.to(tl.int32, bitcast=True)


@triton.jit
def _copy_words(
    src,
    dst,
    n_words,
    page_offset,
    WORD: tl.constexpr,
    LANES: tl.constexpr,
    CHECKSUM: tl.constexpr,
    WRITE: tl.constexpr,
    page_weights_ptr,
    KEYED: tl.constexpr,
):
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

    With ``CHECKSUM``, returns the page-sum contribution (uint64 scalar) of the bytes read:
    wsum64's, or with ``KEYED`` keyed_wsum64's (weights from ``page_weights_ptr``, None
    otherwise); ``page_offset`` (int64) is the pool page offset of the first one (a
    multiple of 4 when ``WORD >= 4``). Without ``WRITE`` nothing is stored. Without
    ``CHECKSUM`` the returned zero is unused and compiled away. Summed loads pass
    ``other=0`` (masked-off lanes must add nothing); plain ones keep the load they had
    (Triton zero-fills masked lanes either way, but the plain kernel stays instruction
    for instruction the same).
    """
    total = tl.zeros((), dtype=tl.uint64)
    if WORD >= 4:
        words = tl.arange(0, LANES)
        lanes = words[:, None] * (WORD // 4) + tl.arange(0, WORD // 4)[None, :]
        start = n_words * 0
        while start < n_words:
            src_ptr = tl.multiple_of((src + start * WORD).to(tl.pointer_type(tl.int32)), WORD)
            dst_ptr = tl.multiple_of((dst + start * WORD).to(tl.pointer_type(tl.int32)), WORD)
            mask = words[:, None] < n_words - start
            data = tl.load(
                src_ptr + lanes,
                mask=mask,
                other=0 if CHECKSUM else None,
                eviction_policy="evict_first",
            )
            if WRITE:
                tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
            if CHECKSUM:
                total += _lane_sums(
                    data, page_offset + start * WORD, lanes, mask, page_weights_ptr, KEYED
                )
            start += LANES
    else:
        src_ptr = src.to(tl.pointer_type(tl.uint8))
        dst_ptr = dst.to(tl.pointer_type(tl.uint8))
        start = n_words * 0
        while start < n_words:
            lanes = start + tl.arange(0, LANES)
            mask = lanes < n_words
            data = tl.load(
                src_ptr + lanes,
                mask=mask,
                other=0 if CHECKSUM else None,
                eviction_policy="evict_first",
            )
            if WRITE:
                tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
            if CHECKSUM:
                offsets = page_offset.to(tl.uint32) + lanes.to(tl.uint32)
                shifted = _byte_words(data, offsets)
                if KEYED:
                    # Byte i of the step sits (page_offset & 3) + lanes[i] bytes past the
                    # first byte's word (lanes[i] < n_words <= TILE_BYTES: int32 is exact).
                    first_word = page_offset >> 2
                    words = ((page_offset & 3).to(tl.int32) + lanes.to(tl.int32)) >> 2
                    weight = _keyed_weights(page_weights_ptr + first_word, words, mask)
                else:
                    weight = _hash_weights(offsets >> 2)
                total += tl.sum(_word_sums(shifted, weight), 0)
            start += LANES
    return total


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
        tl.load(tile + 3, mask=valid, other=0),  # slot stride in the row
        tl.load(tile + 4, mask=valid, other=0),  # tile length
    )


@triton.jit
def _item_addresses(rows, pool_address, pool_row_bytes):
    """An item's device address in the cache, its address in the pool, its offset in the
    pool page (what the page sums weigh by; unused without CHECKSUM) and its bytes."""
    (
        gpu_block,
        pool_row,
        slot,
        block0_address,
        block_stride,
        pool_tile_offset,
        slot_stride,
        item_bytes,
    ) = rows
    page_offset = pool_tile_offset + slot * slot_stride
    cache_address = block0_address + gpu_block * block_stride
    pool_page_address = pool_address + pool_row * pool_row_bytes + page_offset
    return cache_address, pool_page_address, page_offset, item_bytes


@triton.jit
def _copy_unaligned_words(
    src,
    dst,
    item_bytes,
    alignment,
    page_offset,
    LANES: tl.constexpr,
    CHECKSUM: tl.constexpr,
    WRITE: tl.constexpr,
    page_weights_ptr,
    KEYED: tl.constexpr,
):
    """The words of an item whose addresses (``alignment``: their OR) are not 16-byte
    aligned: 8-byte words where both allow, else 4-byte words, else none (the byte tail
    then copies the whole item). Returns the page-sum contribution and the bytes copied."""
    total = tl.zeros((), dtype=tl.uint64)
    done = item_bytes * 0
    # One call per word size: WORD is a constexpr, so each size is its own code path.
    if (alignment & 7) == 0:
        total = _copy_words(
            src,
            dst,
            item_bytes // 8,
            page_offset,
            8,
            LANES,
            CHECKSUM,
            WRITE,
            page_weights_ptr,
            KEYED,
        )
        done = (item_bytes // 8) * 8
    elif (alignment & 3) == 0:
        total = _copy_words(
            src,
            dst,
            item_bytes // 4,
            page_offset,
            4,
            LANES,
            CHECKSUM,
            WRITE,
            page_weights_ptr,
            KEYED,
        )
        done = (item_bytes // 4) * 4
    return total, done


# Every runtime argument is left unspecialized, so ONE compiled kernel serves every job:
# by default Triton specializes a tensor argument on 16-byte alignment and an int on
# ``== 1`` / divisibility by 16. Per-job tables are often slices (``pairs[3n:]`` is
# 16-byte aligned only for even n) and a recompile mid-serving costs ~1 s. The int
# arguments carry annotations so their types do not follow their values either (an
# unannotated int is i32 below 2**31 and i64 above). Nothing is lost: the kernel reads
# the tables with scalar int64 loads, whose alignment the element type already implies.
#
# Page checksums ride the copy (STYLE rule 17): the words are summed from the registers
# the copy loaded them into, after its stores were issued, so a checksummed copy moves no
# extra byte over PCIe or HBM; the item's sum is reduced inside the program and added
# with ONE relaxed atomic, one 8-byte atomic per item (at most TILE_BYTES), not per word.
# The word weights need each lane's word index, so with CHECKSUM the word paths also
# require a 4-byte aligned page offset (where pool rows are 16-byte aligned an item's
# pool address and page offset agree mod 16, so no item changes path for it). The
# reduction across the program's warps (shared memory, a barrier) and the atomic are
# compiled into the checksum variants only: CHECKSUM/WRITE are constexprs. With KEYED (a
# constexpr too) each word's weight is a load from the weights table instead of
# arithmetic on its index: masked exactly like the word's data, so no lane past an item's
# bytes loads a weight, and the highest word loaded is the payload's last.
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
        "page_sums_ptr",
        "pair_pages_ptr",
        "page_weights_ptr",
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
    # The checksum's arguments come last and default to "off" (Python wants defaulted
    # parameters after the others): a launch without them binds, specializes and
    # compiles exactly as before they existed (None pointers are constexprs; unused).
    page_sums_ptr=None,
    pair_pages_ptr=None,
    page_weights_ptr=None,
    CHECKSUM: tl.constexpr = False,
    WRITE: tl.constexpr = True,
    KEYED: tl.constexpr = False,
):
    """Copy every plane page named by the pair table, in the given direction.

    Args:
        tile_table_ptr: int64 ``[num_tiles, 5]``, static. One row per tile of a plane page,
            grouped by cache group, ordered by plane then offset: (device address of the
            tile in block 0 [bytes], block stride [bytes], byte offset of the tile in
            pool slot 0 of a row [bytes], slot stride in the row (the page bytes, or
            more for a fragment of a larger row page) [bytes], tile length [bytes,
            1..TILE_BYTES]).
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
        page_sums_ptr: int64 ``[num_pages]`` or None: the pages' wsum64s (uint64 bits).
        pair_pages_ptr: int64 ``[num_pairs]`` or None, per job: page index of each pair.
        page_weights_ptr: int64 ``[>= words of the longest page]`` or None (with KEYED
            only): the keyed sum's word weights ``r_j`` (uint64 bits), static.
        CHECKSUM: constexpr, add each item's wsum64 to its page's (off: compiled out).
        WRITE: constexpr, store (off, with CHECKSUM: a read-only pass over the source).
        KEYED: constexpr, with CHECKSUM: keyed_wsum64 (weights ``r_j``) instead of wsum64.

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
            cache_address, pool_page_address, page_offset, item_bytes = _item_addresses(
                rows, pool_address, pool_row_bytes
            )
            src = tl.where(to_pool, cache_address, pool_page_address)
            dst = tl.where(to_pool, pool_page_address, cache_address)
            if CHECKSUM:  # the page's sum: the load's latency hides behind the data's
                page = tl.load(pair_pages_ptr + pair)
            item += num_programs  # the position of the next item
            tile_in_pair += tile_step
            carry = tile_in_pair >= tiles_per_pair
            tile_in_pair = tl.where(carry, tile_in_pair - tiles_per_pair, tile_in_pair)
            pair += tl.where(carry, pair_step + 1, pair_step)
            next_row = tile_row0 + tile_in_pair
            valid = item < num_items
            alignment = src | dst
            total = tl.zeros((), dtype=tl.uint64)  # the item's wsum64 (with CHECKSUM)
            if CHECKSUM:  # the word paths weigh each int32 lane by its page word index
                alignment |= page_offset & 3
            if (alignment & 15) == 0:
                # The common path, one step: an item is at most TILE_BYTES = LANES words.
                # The next item's rows are loaded between this item's loads and stores.
                lanes, mask = _wide_lanes(item_bytes // 16, TILE_BYTES // 16)
                src_ptr = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
                dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
                data = tl.load(
                    src_ptr + lanes,
                    mask=mask,
                    other=0 if CHECKSUM else None,
                    eviction_policy="evict_first",
                )
                rows = _item_rows(pairs_ptr, tile_table_ptr, pair, next_row, valid)
                if WRITE:
                    tl.store(dst_ptr + lanes, data, mask=mask, eviction_policy="evict_first")
                if CHECKSUM:
                    total = _lane_sums(data, page_offset, lanes, mask, page_weights_ptr, KEYED)
                done = (item_bytes // 16) * 16
            else:
                rows = _item_rows(pairs_ptr, tile_table_ptr, pair, next_row, valid)
                total, done = _copy_unaligned_words(
                    src,
                    dst,
                    item_bytes,
                    alignment,
                    page_offset,
                    TILE_BYTES // 16,
                    CHECKSUM,
                    WRITE,
                    page_weights_ptr,
                    KEYED,
                )
            # Tail shorter than one word, or the whole item when the addresses are odd.
            total += _copy_words(
                src + done,
                dst + done,
                item_bytes - done,
                page_offset + done,
                1,
                NARROW_BYTES,
                CHECKSUM,
                WRITE,
                page_weights_ptr,
                KEYED,
            )
            if CHECKSUM:  # one atomic per item; int64 bits of the uint64 sum (adds wrap alike)
                tl.atomic_add(page_sums_ptr + page, total.to(tl.int64, bitcast=True), sem="relaxed")
        item_base += num_items
        group += 1


def default_num_programs(
    device: torch.device | str | int, mean_tile_bytes: int = TILE_BYTES
) -> int:
    """Persistent-grid size: enough bytes in flight for PCIe, at most two programs per SM.

    ``ceil(PCIE_IN_FLIGHT_TARGET_BYTES / mean_tile_bytes)`` programs (32 for full 8 KiB
    tiles; see the constant for the reasoning), at most ``MAX_PROGRAMS_PER_SM`` per SM.
    ``mean_tile_bytes`` is the tables' mean item size (``CopyTables.mean_tile_bytes``):
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


def warm_up(
    device: torch.device | str | int,
    tile_bytes: int = TILE_BYTES,
    *,
    checksum: bool = False,
    keyed: bool = False,
) -> None:
    """Compile and load the copy kernel on ``device`` now, so the first job does not wait.

    Launches an empty job (no byte moves) on the current stream of ``device``. No kernel
    argument is specialized on its value or alignment and the launch options are the
    ones :func:`launch_copy` uses for tables cut at ``tile_bytes``, so the kernel
    compiled here is the one every later job runs: a first compile costs ~1 s,
    mid-serving. With ``checksum`` the two checksum variants (copy with page sums, and
    the read-only ``write=False`` pass) are compiled too: with ``keyed`` their keyed
    variants (the ones launches with ``page_weights`` run) instead. Does nothing on CPU
    devices and under the interpreter, where nothing is compiled.
    """
    assert checksum or not keyed, "keyed is a kind of checksum"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if _INTERPRETED or device.type != "cuda":
        return
    with torch.cuda.device(device):
        job = _empty_job(device)
        _copy_blocks_kernel[(1,)](*job, **_launch_options(tile_bytes))
        if checksum:
            # The empty job has no pair: no sum is added, the tensors only bind the types.
            words = torch.zeros(1, dtype=torch.int64, device=device)
            weights = {"page_weights_ptr": words} if keyed else {}
            for write in (True, False):
                _copy_blocks_kernel[(1,)](
                    *job,
                    page_sums_ptr=words,
                    pair_pages_ptr=words,
                    **weights,
                    **_launch_options(tile_bytes, checksum=True, write=write, keyed=keyed),
                )


def launch_copy(
    layout: CopyTables,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    pool_address: int,
    direction: int,
    *,
    num_programs: int | None = None,
    page_sums: torch.Tensor | None = None,
    pair_pages: torch.Tensor | None = None,
    write: bool = True,
    page_weights: torch.Tensor | None = None,
) -> None:
    """Enqueue ONE launch copying the job on the current stream; no checks, no host sync.

    ``layout`` holds the static tables and the tile size they were cut at (the kernel's
    ``TILE_BYTES`` of this launch). ``pairs`` (int64 ``[n, 3]``, contiguous) and
    ``group_offsets`` (int64 ``[num_groups + 1]``) must already be on ``layout.device``
    and valid (the caller validated them). ``pool_address`` is the device-visible address
    of pool row 0; ``direction`` 0 stores (planes -> pool), 1 loads.

    Page checksums (see the module docstring): ``page_sums`` (int64 ``[num_pages]``, on
    ``layout.device``, zeroed by the caller; read the result as uint64) and
    ``pair_pages`` (int64 ``[n]``, contiguous, on ``layout.device``: index into
    ``page_sums`` of each pair's pool row) come together. Each pair's page sum then gains
    the wsum64 contribution of the pool bytes the launch writes (store) or reads (load).
    ``write=False`` (with page sums only) reads the side ``direction`` names as the
    source (0: the GPU blocks, 1: the pool rows), adds the same contributions (weighted
    by the pool offsets the bytes map to) and stores nothing. ``page_weights`` (with page
    sums only; int64 ``[>= ceil(longest page / 4)]``, contiguous, on ``layout.device``;
    None: unkeyed) makes the sums keyed_wsum64s, each word ``j`` weighed by
    ``page_weights[j]`` read as uint64 instead of ``h(j)``. Callers validate; the asserts
    only catch a mix-up of the optional arguments.
    """
    assert (page_sums is None) == (pair_pages is None), "page_sums and pair_pages go together"
    assert write or page_sums is not None, "write=False is a checksum pass: needs page_sums"
    assert page_weights is None or page_sums is not None, "page_weights weigh page sums"
    if pairs.shape[0] == 0:
        return
    if num_programs is None:
        num_programs = default_num_programs(layout.device, layout.mean_tile_bytes)
    checksum = page_sums is not None
    keyed = page_weights is not None
    sums: dict[str, torch.Tensor | None] = {}
    if checksum:  # pointers passed only to the variants that read them (see the kernel)
        sums.update(page_sums_ptr=page_sums, pair_pages_ptr=pair_pages)
    if keyed:
        sums.update(page_weights_ptr=page_weights)
    _copy_blocks_kernel[(num_programs,)](
        layout.tile_table,
        layout.group_table,
        pairs,
        group_offsets,
        pool_address,
        layout.pool_row_bytes,
        layout.num_groups,
        int(direction),
        **sums,
        **_launch_options(layout.tile_bytes, checksum=checksum, write=write, keyed=keyed),
    )


# triton.jit returns an interpreted function when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_copy_blocks_kernel, triton.runtime.JITFunction)
