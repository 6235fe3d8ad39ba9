"""Cache tensors -> byte planes, and the host pool row layout.

Every cache tensor handed to the engine is seen as one *plane* of raw bytes:
``(base address, block stride, page bytes)``. A layer given as a plain tensor is one
plane; a layer given as a tuple of tensors (the K and V views of a ``(2, num_blocks,
...)`` tensor, the conv and SSM states of a Mamba layer) is one plane per tensor.

The pool row layout is plane-major (see the kernel contract): inside the row of
group ``g``, plane ``p`` of ``g`` owns ``blocks_per_chunk`` consecutive pages starting
at ``pool_offset_p``; slot ``s`` of that plane sits at ``pool_offset_p + s *
page_bytes_p``. Every plane start is rounded up to 16 bytes so that a plane whose
pages are 16-byte multiples keeps 16-byte aligned pages in the pool (the kernels use
16-byte accesses only where both sides allow them).

A caller's pool may space its rows wider than ``row_bytes`` (a worker's part of a
shared region): the *row stride* (bytes between rows) is the pool tensor's
``stride(0)``; ``row_bytes`` only sizes what one row holds.

:class:`Plane` is the project's one plane geometry type: the engine, the copiers,
validation and the kernel tables all read it. Validation of a geometry given as bare
planes (``CacheLayout.from_planes``) lives here too; this module imports no Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: A layer of a cache group: one tensor (one plane) or a tuple of tensors (several planes).
Layer = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]

#: Byte alignment of every plane start and of the row length in the pool.
POOL_ALIGNMENT = 16

#: Version of the pool row layout above (plane-major, ``POOL_ALIGNMENT``-aligned plane
#: starts). Bytes kept outside the process (vLLM's secondary tiers) are filed under it:
#: raise it whenever the same caches would give different row bytes.
ROW_LAYOUT_VERSION = 1

_INT64_MAX = (1 << 63) - 1


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} {value} must be >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class Plane:
    """One contiguous-per-block byte region of a cache tensor, and its slots in a pool row.

    All sizes in bytes. ``base_address`` is the device-visible address of block 0
    (``tensor.data_ptr()``); block ``b`` starts at ``base_address + b * block_stride`` and
    its first ``page_bytes`` bytes are copied. Slot ``s`` of this plane in a pool row
    starts ``pool_offset + s * page_bytes`` bytes into the row.

    ``layer``/``index`` say where the plane came from (``index`` is the position inside a
    tuple layer, 0 for a plain tensor). ``view``, when known, is a uint8 ``[num_blocks,
    page_bytes]`` strided view of the same memory (row ``b`` = the page of block ``b``),
    used by the CPU path and by tests; it takes no part in comparisons.

    A *fragment plane* is a piece of a block that lands apart from the rest of it in the
    row (vLLM's canonical pages: one plane per ``CopyRun`` fragment): its ``base_address``
    is the tensor's base plus the fragment's offset inside the block, ``page_bytes`` the
    fragment's length, and ``slot_stride`` (default: ``page_bytes``) the bytes between
    its slots in a row. ``num_writers``/``writer_index``: a store writes slot ``s`` of row
    ``r`` only when the row page ``p = r * blocks_per_chunk + s`` has ``p % num_writers
    == writer_index`` (ranks holding the same bytes take turns); loads read every slot.
    """

    group: int
    base_address: int
    block_stride: int
    page_bytes: int
    num_blocks: int
    pool_offset: int
    layer: int = 0
    index: int = 0
    view: torch.Tensor | None = field(default=None, compare=False, repr=False)
    slot_stride: int | None = None
    num_writers: int = 1
    writer_index: int = 0

    @property
    def name(self) -> str:
        return f"group {self.group} layer {self.layer} plane {self.index}"

    @property
    def pool_slot_stride(self) -> int:
        """Bytes between two slots of this plane in a pool row."""
        return self.page_bytes if self.slot_stride is None else self.slot_stride

    @property
    def writes_every_slot(self) -> bool:
        """Whether a store writes every slot (no writer rotation)."""
        return self.num_writers == 1

    def row_span(self, blocks_per_chunk: int) -> int:
        """One past the last row byte a slot of this plane covers."""
        return self.pool_offset + (blocks_per_chunk - 1) * self.pool_slot_stride + self.page_bytes

    @classmethod
    def of_view(cls, view: torch.Tensor, *, group: int, pool_offset: int) -> Plane:
        """Geometry of a uint8 ``[num_blocks, page_bytes]`` view with a contiguous last dim.

        Raises ValueError on the checks :func:`build_layout` makes of each cache tensor
        (a page that is not contiguous, a block stride smaller than the page, so that
        blocks would overlap).
        """
        if not isinstance(view, torch.Tensor):
            raise TypeError(f"plane view must be a torch.Tensor, got {type(view).__name__}")
        if view.dtype != torch.uint8 or view.dim() != 2:
            raise ValueError(
                f"plane view must be uint8 [num_blocks, page_bytes], got {view.dtype} "
                f"{tuple(view.shape)}"
            )
        check_cache_tensor(view, "plane view")  # a meta view would give base address 0
        num_blocks = view.size(0)
        page_bytes, stride = _block_geometry(view, "plane view")
        if num_blocks == 1:
            # One block: its stride addresses nothing, but the plane checks want one
            # at least a page long.
            stride = max(stride, page_bytes)
        return cls(
            group=group,
            base_address=view.data_ptr(),
            block_stride=stride,
            page_bytes=page_bytes,
            num_blocks=num_blocks,
            pool_offset=pool_offset,
            view=view,
        )


def _extent(plane: Plane) -> tuple[int, int]:
    """First and one-past-last byte any page of ``plane`` covers."""
    return (
        plane.base_address,
        plane.base_address + (plane.num_blocks - 1) * plane.block_stride + plane.page_bytes,
    )


def block_offsets(a: Plane, b: Plane) -> tuple[int, int] | None:
    """For planes of one block stride: the range ``[lo, hi]`` of ``d`` such that block
    ``x`` of ``a`` and block ``x + d`` of ``b`` share bytes, or None when no such pair of
    existing blocks does (or the strides differ).

    Block ``x`` of ``a`` is ``[A + x s, A + x s + pa)``, block ``y`` of ``b`` is ``[B + y s,
    B + y s + pb)``: they meet iff ``A - B - pb < (y - x) s < A - B + pa``.
    """
    stride = a.block_stride
    if b.block_stride != stride:
        return None
    delta = a.base_address - b.base_address
    lo = (delta - b.page_bytes) // stride + 1
    hi = -((-(delta + a.page_bytes)) // stride) - 1
    # Only offsets that pair existing blocks: 0 <= x < na and 0 <= x + d < nb.
    lo, hi = max(lo, 1 - a.num_blocks), min(hi, b.num_blocks - 1)
    return (lo, hi) if lo <= hi else None


def pages_meet(a: Plane, a_blocks: np.ndarray, b: Plane, b_blocks: np.ndarray) -> int:
    """Index into ``a_blocks`` of the first page of ``a`` that shares a byte with a page of
    ``b`` among ``b_blocks`` (any block strides), or -1. Pages of one plane never overlap,
    so ``b``'s pages sorted by start are sorted by end too: one ``searchsorted``."""
    if not a_blocks.size or not b_blocks.size:
        return -1
    starts = a.base_address + a_blocks.astype(np.int64) * a.block_stride
    b_starts = np.sort(b.base_address + b_blocks.astype(np.int64) * b.block_stride)
    b_ends = b_starts + b.page_bytes
    # First page of b ending after each page of a starts; it overlaps iff it starts
    # before that page of a ends.
    first = np.searchsorted(b_ends, starts, side="right")
    inside = first < b_starts.size
    hit = np.zeros(starts.size, dtype=bool)
    hit[inside] = b_starts[first[inside]] < starts[inside] + a.page_bytes
    return int(np.argmax(hit)) if hit.any() else -1


def planes_overlap(a: Plane, b: Plane) -> bool:
    """Whether some page of plane ``a`` shares a byte with some page of plane ``b`` (exact).

    Equal block strides: the closed form of :func:`block_offsets`. Different strides
    (two block sizes over the same memory): every block of ``a`` inside ``b``'s extent
    is checked against ``b``'s pages, vectorized.
    """
    a_start, a_end = _extent(a)
    b_start, b_end = _extent(b)
    if a_end <= b_start or b_end <= a_start:
        return False
    if a.block_stride == b.block_stride:
        return block_offsets(a, b) is not None
    lo = max(0, (b_start - a_start - a.page_bytes) // a.block_stride)
    hi = min(a.num_blocks, (b_end - a_start) // a.block_stride + 1)
    candidates = np.arange(lo, hi, dtype=np.int64)
    return pages_meet(a, candidates, b, np.arange(b.num_blocks, dtype=np.int64)) >= 0


def overlapping_plane_pairs(planes: Sequence[Plane]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of planes that share a byte (exact).

    Sorted by first byte, each plane is compared only with the planes that start before
    it ends: O(P log P) for the usual disjoint caches instead of all P^2 pairs.
    """
    order = sorted(range(len(planes)), key=lambda i: _extent(planes[i])[0])
    extents = [_extent(p) for p in planes]
    found: list[tuple[int, int]] = []
    for position, i in enumerate(order):
        end = extents[i][1]
        for j in order[position + 1 :]:
            if extents[j][0] >= end:
                break
            if planes_overlap(planes[i], planes[j]):
                found.append((min(i, j), max(i, j)))
    return sorted(found)


@dataclass(frozen=True)
class AliasRule:
    """How one plane of group ``group_a`` and one of group ``group_b`` share bytes.

    With equal block strides, block ``x`` of ``plane_a`` meets block ``x + d`` of
    ``plane_b`` exactly for ``d`` in ``offsets`` (``[lo, hi]``); one rule stands for
    every plane pair of the two groups with the same offsets (the first such pair names
    the planes in errors). Otherwise ``offsets`` is None and a job's pages of the two
    planes are compared by byte range.
    """

    group_a: int
    plane_a: int
    group_b: int
    plane_b: int
    offsets: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class CacheSource:
    """A registered cache tensor and what its memory was at registration.

    ``check`` notices ``resize_``/``set_``/storage resizing after registration: the
    planes hold raw addresses, and a reallocated tensor leaves them pointing at freed
    memory (or, after ``set_``, at memory the caller no longer uses).
    """

    tensor: torch.Tensor
    name: str
    data_ptr: int
    storage: torch.UntypedStorage
    storage_bytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor, name: str) -> CacheSource:
        storage = tensor.untyped_storage()
        return cls(tensor, name, tensor.data_ptr(), storage, storage.nbytes())

    def check(self) -> None:
        pointer, size = self.tensor.data_ptr(), self.storage.nbytes()
        if pointer != self.data_ptr or size != self.storage_bytes:
            raise ValueError(
                f"{self.name} was reallocated or resized after the engine was built "
                f"(data pointer {self.data_ptr:#x} -> {pointer:#x}, storage "
                f"{self.storage_bytes} -> {size} bytes): its planes would address freed "
                "memory; build a new engine for the new tensor"
            )


@dataclass(frozen=True)
class CacheLayout:
    """All planes of all groups, ordered by group, plus the pool row geometry.

    ``group_row_bytes[g]`` is the number of bytes a row of group ``g`` uses;
    ``row_bytes`` (what one pool row holds) is at least their maximum (rounded up to
    16 by :func:`build_layout`). ``bytes_per_block[g]`` is the number of bytes one GPU
    block of group ``g`` moves (the sum of the page bytes of g's planes). Groups may
    alias the same cache memory (hybrid allocators share tensors across groups, also
    with other block sizes or shifted views): ``cache_alias_groups`` lists the group
    pairs with planes that share bytes and ``alias_rules`` says how, per plane pair
    (jobs are checked by byte range with them); two groups of ``pool_shared_groups``
    use the same bytes of a row. Two planes of one group never share a byte (refused:
    a load would write those bytes twice). ``sources`` are the registered tensors
    (from :func:`build_layout`; empty for bare planes): the layout stores addresses,
    so :meth:`check_sources` refuses to go on once one of them was reallocated.
    """

    planes: tuple[Plane, ...]
    num_groups: int
    blocks_per_chunk: int
    group_num_blocks: tuple[int, ...]
    group_planes: tuple[tuple[int, ...], ...]
    group_row_bytes: tuple[int, ...]
    bytes_per_block: tuple[int, ...]
    row_bytes: int
    device: torch.device
    cache_alias_groups: tuple[tuple[int, int], ...] = ()
    pool_shared_groups: tuple[tuple[int, int], ...] = ()
    alias_rules: tuple[AliasRule, ...] = ()
    sources: tuple[CacheSource, ...] = field(default=(), compare=False, repr=False)

    @functools.cached_property
    def writer_classes(self) -> tuple[tuple[int, int], ...]:
        """Distinct ``(num_writers, writer_index)`` of the planes, sorted."""
        return tuple(sorted({(p.num_writers, p.writer_index) for p in self.planes}))

    def check_sources(self) -> None:
        """ValueError naming the first plane whose tensor was reallocated or resized
        since registration (one pointer and one size comparison per tensor)."""
        for source in self.sources:
            source.check()

    @classmethod
    def from_planes(
        cls,
        planes: Sequence[Plane],
        *,
        num_groups: int,
        blocks_per_chunk: int,
        row_bytes: int,
        device: torch.device | str,
    ) -> CacheLayout:
        """Validate bare plane geometry (ordered by group); ValueError naming the bad field.

        Slots of one group's planes must not share row bytes and must fit in
        ``row_bytes``; addresses must fit in int64. A group may have no plane (its jobs
        then move nothing).
        """
        num_groups = check_int("num_groups", num_groups, 1)
        blocks_per_chunk = check_int("blocks_per_chunk", blocks_per_chunk, 1)
        row_bytes = check_int("row_bytes", row_bytes, 1)
        planes = tuple(planes)
        previous_group = 0
        for index, plane in enumerate(planes):
            if not isinstance(plane, Plane):
                raise TypeError(f"plane {index} must be a Plane, got {plane!r}")
            what = f"plane {index}"
            group = check_int(f"{what} group", plane.group, 0)
            if group >= num_groups:
                raise ValueError(f"{what} group {group} out of range [0, {num_groups})")
            if group < previous_group:
                raise ValueError(
                    f"{what} group {group} follows group {previous_group}: planes must be "
                    "ordered by group"
                )
            previous_group = group
            check_int(f"{what} base_address", plane.base_address, 1)
            page = check_int(f"{what} page_bytes", plane.page_bytes, 1)
            num_blocks = check_int(f"{what} num_blocks", plane.num_blocks, 1)
            stride = check_int(f"{what} block_stride", plane.block_stride, 1)
            offset = check_int(f"{what} pool_offset", plane.pool_offset, 0)
            slot_stride = page
            if plane.slot_stride is not None:
                slot_stride = check_int(f"{what} slot_stride", plane.slot_stride, 1)
                if slot_stride < page:
                    raise ValueError(
                        f"{what} slot_stride {slot_stride} is smaller than page_bytes {page}: "
                        "its slots would overlap in a row"
                    )
            writers = check_int(f"{what} num_writers", plane.num_writers, 1)
            index_of_writer = check_int(f"{what} writer_index", plane.writer_index, 0)
            if index_of_writer >= writers:
                raise ValueError(
                    f"{what} writer_index {index_of_writer} out of range [0, {writers})"
                )
            if num_blocks > 1 and stride < page:
                raise ValueError(
                    f"{what} block_stride {stride} is smaller than page_bytes {page}: "
                    "blocks would overlap"
                )
            if plane.base_address + (num_blocks - 1) * stride + page > _INT64_MAX:
                raise ValueError(f"{what} address range overflows int64")
            if offset + (blocks_per_chunk - 1) * slot_stride + page > row_bytes:
                raise ValueError(
                    f"{what} pool_offset {offset} + {blocks_per_chunk} slots x {page} bytes "
                    + (f"({slot_stride} apart) " if slot_stride != page else "")
                    + f"exceeds row_bytes {row_bytes}"
                )
        group_planes = tuple(
            tuple(i for i, p in enumerate(planes) if p.group == g) for g in range(num_groups)
        )
        for group, members in enumerate(group_planes):
            # Planes of one group must not share bytes of a pool row (a store would clobber).
            _check_row_disjoint(planes, members, blocks_per_chunk, group)
        cache_alias: set[tuple[int, int]] = set()
        rules: list[AliasRule] = []
        seen_offsets: set[tuple[int, int, tuple[int, int]]] = set()
        for i, j in overlapping_plane_pairs(planes):
            a, b = planes[i], planes[j]
            if a.group == b.group:
                # A load of one block would write these bytes twice (once per plane), and
                # which write lands last is up to the copier.
                raise ValueError(
                    f"plane {j} ({b.name}) overlaps plane {i} ({a.name}): two planes of "
                    "one group may not share cache bytes"
                )
            cache_alias.add((a.group, b.group))
            offsets = block_offsets(a, b)
            if offsets is not None:
                # Layer pairs of two groups sharing tensors all meet at the same block
                # offsets: one rule checks them all (a job costs one lookup per rule).
                if (a.group, b.group, offsets) in seen_offsets:
                    continue
                seen_offsets.add((a.group, b.group, offsets))
            rules.append(AliasRule(a.group, i, b.group, j, offsets))
        pool_shared = _pool_shared_groups(planes, group_planes, blocks_per_chunk)
        return cls(
            planes=planes,
            num_groups=num_groups,
            blocks_per_chunk=blocks_per_chunk,
            # A group without planes (possible only from bare planes) has no block limit.
            group_num_blocks=tuple(
                min((planes[i].num_blocks for i in m), default=_INT64_MAX) for m in group_planes
            ),
            group_planes=group_planes,
            group_row_bytes=tuple(
                max((planes[i].row_span(blocks_per_chunk) for i in m), default=0)
                for m in group_planes
            ),
            bytes_per_block=tuple(sum(planes[i].page_bytes for i in m) for m in group_planes),
            row_bytes=row_bytes,
            device=torch.device(device),
            cache_alias_groups=tuple(sorted(cache_alias)),
            pool_shared_groups=pool_shared,
            alias_rules=tuple(rules),
        )


def _row_intervals(
    planes: Sequence[Plane], members: Sequence[int], blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, plane indices) of every slot of ``members`` in a row, sorted by start."""
    if not members:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    chosen = [planes[i] for i in members]
    offsets = np.array([p.pool_offset for p in chosen], dtype=np.int64)[:, None]
    strides = np.array([p.pool_slot_stride for p in chosen], dtype=np.int64)[:, None]
    pages = np.array([p.page_bytes for p in chosen], dtype=np.int64)[:, None]
    slots = np.arange(blocks_per_chunk, dtype=np.int64)[None, :]
    starts = (offsets + slots * strides).ravel()
    ends = starts + np.broadcast_to(pages, (len(chosen), blocks_per_chunk)).ravel()
    owners = np.repeat(np.asarray(members, dtype=np.int64), blocks_per_chunk)
    order = np.argsort(starts, kind="stable")
    return starts[order], ends[order], owners[order]


def _check_row_disjoint(
    planes: Sequence[Plane], members: Sequence[int], blocks_per_chunk: int, group: int
) -> None:
    """ValueError when two slots of one group's planes share bytes of a row (vectorized:
    fragment planes interleave their slots, so whole-plane spans do not decide it)."""
    starts, ends, owners = _row_intervals(planes, members, blocks_per_chunk)
    if starts.size < 2:
        return
    reach = np.maximum.accumulate(ends)
    clash = np.flatnonzero(starts[1:] < reach[:-1])
    if clash.size:
        k = int(clash[0]) + 1
        i = int(owners[int(np.argmax(ends[:k] > starts[k]))])
        j = int(owners[k])
        first, second = sorted((planes[i], planes[j]), key=lambda p: p.pool_offset)
        i, j = (i, j) if first is planes[i] else (j, i)
        raise ValueError(
            f"plane {j} pool_offset {second.pool_offset} overlaps plane {i}'s slots "
            f"(ending at byte {first.row_span(blocks_per_chunk)}) in the rows of group {group}"
        )


def _pool_shared_groups(
    planes: Sequence[Plane], group_planes: Sequence[Sequence[int]], blocks_per_chunk: int
) -> tuple[tuple[int, int], ...]:
    """Sorted pairs of groups whose planes use some same bytes of a row."""
    merged = []
    for members in group_planes:
        starts, ends, _ = _row_intervals(planes, members, blocks_per_chunk)
        merged.append((starts, ends))
    shared = []
    for g, (a_starts, a_ends) in enumerate(merged):
        for h in range(g + 1, len(merged)):
            b_starts, b_ends = merged[h]
            if not a_starts.size or not b_starts.size:
                continue
            # Slots of one group are disjoint and sorted: the first b slot ending after
            # each a slot starts overlaps it iff it starts before that a slot ends.
            first = np.searchsorted(b_ends, a_starts, side="right")
            inside = first < b_starts.size
            if np.any(b_starts[first[inside]] < a_ends[inside]):
                shared.append((g, h))
    return tuple(shared)


def check_pool_placement(pool: torch.Tensor, layout: CacheLayout) -> None:
    """ValueError unless a caller's pool is reachable and shares no byte with a cache.

    A pool on another device than the caches (a CUDA pool for CPU caches, another GPU)
    cannot be addressed by the copies; a pool that is a view of cache memory would have
    stores write into the cache. The pool is compared as one more plane (rows of
    ``row_bytes``, ``row_stride`` apart) with every cache plane, byte-exactly.
    """
    device = layout.device
    other_gpu = (
        pool.device.index is not None
        and device.index is not None
        and pool.device.index != device.index
    )
    if pool.device.type == "cuda" and (device.type != "cuda" or other_gpu):
        raise ValueError(
            f"pool is on {pool.device} but the caches are on {device}: a device pool must "
            "live on the caches' GPU (or give a pinned host pool)"
        )
    if pool.device.type != device.type:
        return  # host pool, device caches: separate memories
    rows, row_bytes = pool.shape
    pool_plane = Plane(
        group=0,
        base_address=pool.data_ptr(),
        block_stride=int(pool.stride(0)) if rows > 1 else row_bytes,
        page_bytes=row_bytes,
        num_blocks=rows,
        pool_offset=0,
    )
    for plane in layout.planes:
        if planes_overlap(pool_plane, plane):
            raise ValueError(
                f"pool [{pool_plane.base_address:#x}, +{rows} rows of {row_bytes} bytes) "
                f"overlaps {plane.name}: a store would write into the cache"
            )


def _plane_tensors(layer: Any, group: int, layer_index: int) -> list[torch.Tensor]:
    if isinstance(layer, torch.Tensor):
        return [layer]
    if isinstance(layer, (tuple, list)) and layer:
        for index, tensor in enumerate(layer):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"group {group} layer {layer_index} plane {index}: expected a tensor, "
                    f"got {type(tensor).__name__}"
                )
        return list(layer)
    raise TypeError(
        f"group {group} layer {layer_index}: expected a tensor or a non-empty tuple of "
        f"tensors, got {layer!r:.80}"
    )


def check_cache_tensor(tensor: torch.Tensor, name: str) -> None:
    """ValueError unless ``tensor`` has memory and at least one block: checked first,
    before its device, strides or address are read, which would misname the problem (a
    meta tensor's address is 0 and its device differs from the others; a 0-block
    tensor's strides are arbitrary, so its empty blocks may look non-contiguous)."""
    if tensor.is_meta:
        raise ValueError(
            f"cache tensor {name} (shape {tuple(tensor.shape)}) is on the meta device: it "
            "has no memory to copy from or to"
        )
    if tensor.dim() >= 1 and tensor.size(0) == 0:
        raise ValueError(
            f"{name} has 0 blocks (shape {tuple(tensor.shape)}); a cache tensor needs at "
            "least one block"
        )


def _page_bytes(tensor: torch.Tensor, name: str) -> int:
    """Bytes of one block of ``tensor``; ValueError unless that region is contiguous."""
    if tensor.dim() < 1:
        raise ValueError(f"{name}: a 0-d tensor has no block dimension")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(f"{name}: layout {tensor.layout} is not a strided tensor")
    expected = 1
    for dim in range(tensor.dim() - 1, 0, -1):
        size = tensor.size(dim)
        if size != 1 and tensor.stride(dim) != expected:
            raise ValueError(
                f"{name}: the bytes of one block are not contiguous (shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}); each block's region "
                "must be contiguous, only the block dimension may be strided"
            )
        expected *= size
    page_bytes = expected * tensor.element_size()
    if page_bytes == 0:
        raise ValueError(f"{name}: a block holds 0 bytes (shape {tuple(tensor.shape)})")
    return page_bytes


def _block_geometry(tensor: torch.Tensor, name: str) -> tuple[int, int]:
    """(page bytes, block stride in bytes) of ``tensor``; ValueError unless each block's
    bytes are contiguous and blocks do not overlap (stride at least a page)."""
    page_bytes = _page_bytes(tensor, name)
    block_stride = tensor.stride(0) * tensor.element_size()
    if tensor.size(0) > 1 and block_stride < page_bytes:
        raise ValueError(
            f"{name}: block stride {block_stride} bytes is smaller than the "
            f"{page_bytes} bytes of a block; blocks would overlap"
        )
    return page_bytes, block_stride


def byte_view(tensor: torch.Tensor, block_stride: int, page_bytes: int) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of ``tensor``'s storage, any dtype.

    Row ``b`` starts ``b * block_stride`` bytes after ``tensor``'s first element; writes
    through the view land in the tensor. The caller checked that the page is contiguous.
    """
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage())
    return raw.as_strided(
        (tensor.size(0), page_bytes),
        (block_stride, 1),
        tensor.storage_offset() * tensor.element_size(),
    )


def build_layout(
    caches: Sequence[Sequence[Layer]],
    *,
    num_groups: int,
    blocks_per_chunk: int,
) -> CacheLayout:
    """Turn ``caches[g][layer]`` into planes and the plane-major pool row layout.

    Raises ValueError naming the group/layer for a wrong number of groups, no layer in
    any group, a tensor with 0 blocks, a plane whose per-block bytes are not
    contiguous, overlapping blocks, planes of one group with different block counts or
    sharing bytes, or tensors on different devices. A group without layers is valid.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise TypeError(f"caches must be a sequence (one entry per group), got {type(caches)}")
    if len(caches) != num_groups:
        raise ValueError(f"caches has {len(caches)} groups but the plan has {num_groups} groups")
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk {blocks_per_chunk} must be >= 1")
    planes: list[Plane] = []
    sources: list[CacheSource] = []
    group_row_bytes: list[int] = []
    device: torch.device | None = None
    first_name = ""
    for group, layers in enumerate(caches):
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise TypeError(
                f"caches[{group}] must be a sequence of layers, got {type(layers).__name__}"
            )
        # A group may hold no layer here: a pipeline stage that holds none of that
        # group's layers still takes part in every job (its pairs move nothing).
        num_blocks: int | None = None
        offset = 0
        for layer_index, layer in enumerate(layers):
            for index, tensor in enumerate(_plane_tensors(layer, group, layer_index)):
                name = f"group {group} layer {layer_index} plane {index}"
                check_cache_tensor(tensor, name)
                if device is None:
                    device, first_name = tensor.device, name
                elif tensor.device != device:
                    raise ValueError(
                        f"{name} is on {tensor.device} but {first_name} is on {device}; "
                        "all cache tensors must be on one device"
                    )
                page_bytes, block_stride = _block_geometry(tensor, name)
                blocks = tensor.size(0)
                if num_blocks is None:
                    num_blocks = blocks
                elif blocks != num_blocks:
                    raise ValueError(
                        f"{name} has {blocks} blocks but group {group} layer 0 has "
                        f"{num_blocks}; all caches of one group need the same block count"
                    )
                offset = _round_up(offset, POOL_ALIGNMENT)
                planes.append(
                    Plane(
                        group=group,
                        layer=layer_index,
                        index=index,
                        base_address=tensor.data_ptr(),
                        block_stride=block_stride,
                        page_bytes=page_bytes,
                        num_blocks=blocks,
                        pool_offset=offset,
                        view=byte_view(tensor, block_stride, page_bytes),
                    )
                )
                sources.append(CacheSource.of(tensor, name))
                offset += blocks_per_chunk * page_bytes
        group_row_bytes.append(offset)
    if device is None:
        raise ValueError(
            f"caches hold no layer in any of the {num_groups} groups: nothing to offload"
        )
    layout = CacheLayout.from_planes(
        planes,
        num_groups=num_groups,
        blocks_per_chunk=blocks_per_chunk,
        row_bytes=_round_up(max(group_row_bytes), POOL_ALIGNMENT),
        device=device,
    )
    return dataclasses.replace(layout, sources=tuple(sources))


def pool_plane_view(pool: torch.Tensor, plane: Plane, blocks_per_chunk: int) -> torch.Tensor:
    """uint8 ``[pool_rows, blocks_per_chunk, page_bytes]`` view of ``plane``'s pool pages."""
    assert pool.dtype == torch.uint8 and pool.dim() == 2 and pool.stride(1) == 1
    return pool.as_strided(
        (pool.size(0), blocks_per_chunk, plane.page_bytes),
        (pool.stride(0), plane.pool_slot_stride, 1),
        pool.storage_offset() + plane.pool_offset,
    )


__all__ = [
    "POOL_ALIGNMENT",
    "ROW_LAYOUT_VERSION",
    "AliasRule",
    "CacheLayout",
    "CacheSource",
    "Layer",
    "Plane",
    "block_offsets",
    "build_layout",
    "byte_view",
    "check_cache_tensor",
    "check_int",
    "check_pool_placement",
    "overlapping_plane_pairs",
    "pages_meet",
    "planes_overlap",
    "pool_plane_view",
]
