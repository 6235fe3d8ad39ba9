"""Copiers: the ways a validated job's pages move, behind one small interface.

A :class:`Copier` takes a job's pair table, its direction and the planes it is asked to
move (all planes, or a subset when a job is split between copiers) and returns, from
``prepare``, a callable that enqueues the copy. ``prepare`` does the host work (address
arithmetic, staging of tables, their upload on the current stream) so that the engine
can record a job's start event after it: the timed span is the copy itself.

- :class:`HostCopier` (``"torch"``): the CPU memmove path of ``cpu_copy`` (no CUDA,
  no Triton).
- :class:`DmaCopier` (``"dma"``): the copy engines, one ``cuMemcpyBatchAsync`` per
  job (a per-run ``cudaMemcpyAsync`` loop on drivers before 12.8).
- :class:`TritonCopier` (``"triton"``): one launch of the copy kernel covering every
  group, plane and block it is given (CUDA, or CPU tensors under the interpreter).

All copiers address pool row ``r`` at ``pool_address + r * row_stride``: the row stride
of the pool tensor, which may exceed the bytes a row holds, and slot ``s`` of a plane
``plane.pool_slot_stride`` bytes after slot ``s - 1``. Every copier splits a store by
writer rotation first (``jobs.writer_parts``): a plane's slots that another rank writes
are never touched.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import torch

from triton_offload.transfer import cpu_copy
from triton_offload.transfer.batch_copy import BatchCopy
from triton_offload.transfer.checksums import gap_ranges
from triton_offload.transfer.jobs import Direction, PairTable, validate_pairs, writer_parts
from triton_offload.transfer.layout import CacheLayout, check_int, check_pool_placement

#: Pinned staging buffers kept for pair tables; more in-flight jobs than this wait
#: for the oldest buffer's job to finish before reusing it.
MAX_STAGING_BUFFERS = 64

#: The most programs a copy-kernel grid may have. The kernel is persistent (each program
#: walks items with a grid stride), so programs beyond the items only start and exit;
#: the launcher's default is a few per SM (a few hundred on the largest GPUs). 2**31
#: programs exceed CUDA's grid x limit and failed every job at launch.
MAX_NUM_PROGRAMS = 1 << 16


def check_num_programs(value: object, name: str = "num_programs") -> int:
    """``value`` as a grid size in ``[1, MAX_NUM_PROGRAMS]``; TypeError/ValueError naming
    ``name`` and the value otherwise."""
    programs = check_int(name, value, 1)
    if programs > MAX_NUM_PROGRAMS:
        raise ValueError(
            f"{name} {programs} must be at most {MAX_NUM_PROGRAMS} (the copy kernel is "
            "persistent: more programs than items only start and exit)"
        )
    return programs


#: Planes a copier is asked to move: indices into ``layout.planes`` (sorted), or None
#: for all of them.
PlaneSubset = tuple[int, ...] | None


@dataclass
class JobHolds:
    """What a job keeps until it ends: device tables, and staging to release after it."""

    keep_alive: list[Any] = field(default_factory=list)
    releases: list[Callable[[Any], None]] = field(default_factory=list)

    def release_after(self, event: Any) -> None:
        for release in self.releases:
            release(event)
        self.releases.clear()


class Copier(abc.ABC):
    """One way of moving pages; ``name`` is what the engine reports for the jobs it ran."""

    name: ClassVar[str]

    @abc.abstractmethod
    def prepare(
        self,
        table: PairTable,
        direction: int,
        planes: PlaneSubset,
        holds: JobHolds,
        stream: Any,
    ) -> Callable[[], None]:
        """Host work for one job; returns the call that enqueues (or, on CPU, does) the copy.

        ``stream`` is the CUDA stream the copy will run on (None on CPU); anything this
        enqueues goes onto the current stream, which the engine made ``stream``.
        """


def _planes_of(layout: CacheLayout, planes: PlaneSubset) -> PlaneSubset:
    return None if planes is None or len(planes) == len(layout.planes) else planes


class HostCopier(Copier):
    """The CPU path: one ``memmove`` per merged run (see ``cpu_copy``)."""

    name = "torch"

    def __init__(self, layout: CacheLayout, pool_address: int, row_stride: int) -> None:
        self.layout = layout
        self.pool_address = pool_address
        self.row_stride = row_stride
        self._runs = cpu_copy.RunBuilder(layout)

    def prepare(
        self,
        table: PairTable,
        direction: int,
        planes: PlaneSubset,
        holds: JobHolds,
        stream: Any,
        *,
        hashed: memoryview | None = None,
        digest: Callable[[memoryview], int] | None = None,
    ) -> Callable[[], Any]:
        """The job's copy. With ``hashed`` (the pool's bytes, ``cpu_copy.pool_bytes``)
        the copy hashes each row it names right after copying it and returns a
        ``cpu_copy.HashedCopy`` (a checksummed job: its pages are written whole, one
        part, every plane); ``digest`` is the hash (XXH3-64 when None)."""
        layout, address, stride = self.layout, self.pool_address, self.row_stride
        if planes is not None and len(planes) == len(layout.planes):
            planes = None
        if hashed is not None:
            assert planes is None, planes
            return functools.partial(
                cpu_copy.copy_and_hash_pages,
                layout,
                address,
                stride,
                table.pairs,
                table.offsets,
                direction,
                hashed,
                runs=self._runs,
                digest=digest,
            )
        parts = writer_parts(layout, table, direction, planes)
        if len(parts) == 1:  # a load, or a store whose planes all write every slot
            part, subset = parts[0]
            # Looked up per job, not per engine: the module's function is the copy.
            return functools.partial(
                cpu_copy.copy_pages,
                layout,
                address,
                stride,
                part.pairs,
                part.offsets,
                direction,
                planes=subset,
                runs=self._runs,
            )

        def run() -> None:
            for part, subset in parts:
                cpu_copy.copy_pages(
                    layout,
                    address,
                    stride,
                    part.pairs,
                    part.offsets,
                    direction,
                    planes=subset,
                    runs=self._runs,
                )

        return run


@dataclass(frozen=True, eq=False)
class _PlaneClass:
    """Planes of one group sharing a block stride, a page and a pool slot stride.

    Whether two consecutive pairs of a job form one run depends only on these three
    numbers and the pairs, so one run pattern (O(pairs) numpy) serves every plane of
    the class; each plane then differs only by its cache base and its pool offset.
    """

    block_stride: int
    page_bytes: int
    slot_stride: int
    bases: np.ndarray  # int64 [k, 1]: cache address of block 0 of each plane
    offsets: np.ndarray  # int64 [k, 1]: each plane's pool_offset
    positions: np.ndarray  # int64 [k]: each plane's position among its group's planes


@dataclass(frozen=True, eq=False)
class _GroupPlanes:
    """A group's planes in a plane subset, by class; ``class_of`` maps each plane (in
    plane order) to its class."""

    count: int
    classes: tuple[_PlaneClass, ...]
    class_of: np.ndarray


class DescriptorBuffers:
    """One set of a DMA job's descriptor arrays, allocated once and reused.

    ``targets``/``sources``/``lengths`` are int64 (handed to the driver as uint64 views);
    ``values``/``indices`` are the scratch of a group whose planes fall in several
    classes (its runs are computed class by class and scattered into plane order).
    Arrays grow (to at least twice their size) when a larger job arrives and never
    shrink: arrays allocated per job (large ones come fresh from the system) cost a
    page fault per 4 KiB on first touch, and the build grows superlinearly with the job
    (measured with numpy's allocations: 0.17 ms at 256 blocks x 64 planes, 1.4 ms and
    864 page faults at 1,024; ``bench/suites/bench_descriptors.py`` times this build).
    """

    MIN_CAPACITY = 1 << 12

    def __init__(self) -> None:
        self.targets = self.sources = self.lengths = np.zeros(0, dtype=np.int64)
        self.values = self.indices = np.zeros(0, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return int(self.lengths.size)

    def reserve(self, count: int) -> None:
        """Room for ``count`` descriptors (the contents are not kept)."""
        if count > self.lengths.size:
            size = max(count, 2 * self.lengths.size, self.MIN_CAPACITY)
            self.targets, self.sources, self.lengths = (
                np.empty(size, dtype=np.int64) for _ in range(3)
            )

    def scratch(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``values``/``indices`` with room for ``count`` entries."""
        if count > self.values.size:
            size = max(count, 2 * self.values.size, self.MIN_CAPACITY)
            self.values, self.indices = (np.empty(size, dtype=np.int64) for _ in range(2))
        return self.values, self.indices


class DescriptorHold:
    """One job's hold on a descriptor set: ``release`` gives the set back once, however
    often it is called (after the driver call, and again with the job's holds)."""

    def __init__(self, pool: DescriptorPool, buffers: DescriptorBuffers) -> None:
        self.pool = pool
        self.buffers = buffers
        self.released = False

    def release(self, event: Any = None) -> None:
        """Give the set back (``event`` is ignored: the driver read the descriptors during
        its call, so nothing on the device waits for them)."""
        self.pool._give_back(self)


class DescriptorPool:
    """Descriptor sets shared by the jobs of one copier, each held by one job at a time.

    A job takes a set in ``prepare`` and gives it back once its driver call returned
    (the driver reads the descriptors during the call, ``batch_copy``), or when the job's
    holds are released if its call never ran. Lanes preparing jobs concurrently (one
    thread per lane on CPU; several stages and jobs prepared before their calls run in a
    layer-staged load) each hold their own set: the pool grows to the number held at
    once and keeps them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[DescriptorBuffers] = []
        self._held = 0

    def acquire(self) -> DescriptorHold:
        with self._lock:
            buffers = self._free.pop() if self._free else DescriptorBuffers()
            self._held += 1
        return DescriptorHold(self, buffers)

    def _give_back(self, hold: DescriptorHold) -> None:
        with self._lock:
            if not hold.released:
                hold.released = True
                self._held -= 1
                self._free.append(hold.buffers)

    @property
    def held(self) -> int:
        """Sets taken by jobs and not given back yet."""
        with self._lock:
            return self._held

    @property
    def free(self) -> int:
        """Sets waiting for the next job."""
        with self._lock:
            return len(self._free)


class DescriptorBuilder:
    """The merged runs of a DMA job, written into a :class:`DescriptorBuffers` set.

    Runs are the CPU path's (``cpu_copy``): per group, per plane, the pairs in order;
    consecutive pairs are one run when their pages are adjacent on both sides (cache
    address and pool address each one page further). Ordered by writer part, group,
    plane, pair. Work per group: O(pairs) numpy per plane class (usually one: every
    plane of a group of K/V layers has the same strides), then one broadcast per output
    array over (planes x runs), written in place; no array of the job's size is
    allocated.
    """

    def __init__(self, layout: CacheLayout, pool_address: int, row_stride: int) -> None:
        self.layout = layout
        self.pool_address = pool_address
        self.row_stride = row_stride
        self._plans: dict[tuple[int, ...] | None, tuple[_GroupPlanes | None, ...]] = {}

    def _groups(self, planes: Sequence[int] | None) -> tuple[_GroupPlanes | None, ...]:
        key = None if planes is None else tuple(sorted(planes))
        plan = self._plans.get(key)
        if plan is None:
            wanted = None if key is None else frozenset(key)
            groups: list[_GroupPlanes | None] = []
            for members in self.layout.group_planes:
                chosen = [self.layout.planes[i] for i in members if wanted is None or i in wanted]
                if not chosen:
                    groups.append(None)
                    continue
                keys: dict[tuple[int, int, int], list[int]] = {}
                for position, plane in enumerate(chosen):
                    geometry = (plane.block_stride, plane.page_bytes, plane.pool_slot_stride)
                    keys.setdefault(geometry, []).append(position)
                class_of = np.zeros(len(chosen), dtype=np.int64)
                classes = []
                for number, ((stride, page, slot_stride), positions) in enumerate(keys.items()):
                    class_of[positions] = number
                    classes.append(
                        _PlaneClass(
                            block_stride=stride,
                            page_bytes=page,
                            slot_stride=slot_stride,
                            bases=np.array(
                                [chosen[i].base_address for i in positions], dtype=np.int64
                            )[:, None],
                            offsets=np.array(
                                [chosen[i].pool_offset for i in positions], dtype=np.int64
                            )[:, None],
                            positions=np.array(positions, dtype=np.int64),
                        )
                    )
                groups.append(_GroupPlanes(len(chosen), tuple(classes), class_of))
            plan = self._plans[key] = tuple(groups)
        return plan

    def build(
        self, buffers: DescriptorBuffers, table: PairTable, direction: int, planes: PlaneSubset
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(targets, sources, lengths) of every merged run of the job: uint64 views of
        ``buffers``, valid until the set is next written. A store's slots that another
        rank writes are left out (writer rotation)."""
        assert direction in (Direction.TO_POOL, Direction.FROM_POOL)
        parts = [
            (part, self._groups(subset))
            for part, subset in writer_parts(
                self.layout, table, direction, _planes_of(self.layout, planes)
            )
        ]
        # At most one run per page: the bound sizes the set before anything is written.
        bound = 0
        for part, groups in parts:
            sizes = np.diff(part.offsets).tolist()
            bound += sum(n * g.count for n, g in zip(sizes, groups, strict=True) if g is not None)
        buffers.reserve(bound)
        count = 0
        for part, groups in parts:
            count = self._fill(buffers, count, part, direction, groups)
        assert count <= bound
        return (
            buffers.targets[:count].view(np.uint64),
            buffers.sources[:count].view(np.uint64),
            buffers.lengths[:count].view(np.uint64),
        )

    def _fill(
        self,
        buffers: DescriptorBuffers,
        count: int,
        table: PairTable,
        direction: int,
        groups: tuple[_GroupPlanes | None, ...],
    ) -> int:
        pairs, offsets = table
        bounds = offsets.tolist()
        if direction == Direction.TO_POOL:
            cache_side, pool_side = buffers.sources, buffers.targets
        else:
            cache_side, pool_side = buffers.targets, buffers.sources
        lengths = buffers.lengths
        for group, planes in enumerate(groups):
            lo, hi = bounds[group], bounds[group + 1]
            if planes is None or lo == hi:
                continue
            blocks = pairs[lo:hi, 0]
            slots = pairs[lo:hi, 2]
            rows = pairs[lo:hi, 1] * self.row_stride + self.pool_address
            steps = (np.diff(blocks), np.diff(rows), np.diff(slots))
            patterns = [_run_pattern(c, blocks, rows, slots, steps) for c in planes.classes]
            if len(patterns) == 1:
                (plane_class,) = planes.classes
                cache, pool, length = patterns[0]
                runs, k = cache.size, planes.count
                end = count + k * runs
                np.add(plane_class.bases, cache, out=cache_side[count:end].reshape(k, runs))
                np.add(plane_class.offsets, pool, out=pool_side[count:end].reshape(k, runs))
                lengths[count:end].reshape(k, runs)[:] = length
                count = end
                continue
            # Several classes: each plane's runs go to its place in plane order.
            per_plane = np.array([p[0].size for p in patterns], dtype=np.int64)[planes.class_of]
            firsts = np.cumsum(per_plane) - per_plane + count
            for plane_class, (cache, pool, length) in zip(planes.classes, patterns, strict=True):
                runs, k = cache.size, plane_class.positions.size
                values, indices = buffers.scratch(k * runs)
                where = indices[: k * runs].reshape(k, runs)
                value = values[: k * runs].reshape(k, runs)
                np.add(firsts[plane_class.positions][:, None], np.arange(runs), out=where)
                np.add(plane_class.bases, cache, out=value)
                cache_side[where] = value
                np.add(plane_class.offsets, pool, out=value)
                pool_side[where] = value
                lengths[where] = length
            count += int(per_plane.sum())
        return count


def _run_pattern(
    plane_class: _PlaneClass,
    blocks: np.ndarray,
    rows: np.ndarray,
    slots: np.ndarray,
    steps: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of one plane class over a group's pairs, without the per-plane terms:
    (cache offset from the plane's base, pool address less the plane's pool_offset,
    bytes) of each run's first page, int64 1-D. ``rows``: each pair's pool row address;
    ``steps``: the differences of blocks, row addresses and slots between neighbours."""
    stride, page, slot_stride = (
        plane_class.block_stride,
        plane_class.page_bytes,
        plane_class.slot_stride,
    )
    block_steps, row_steps, slot_steps = steps
    # A pair continues the run of the one before it when both its pages are the next
    # page on each side: block step x stride == page and row step + slot step x slot
    # stride == page.
    joins = (block_steps * stride == page) & (row_steps + slot_steps * slot_stride == page)
    if not joins.any():
        return blocks * stride, rows + slots * slot_stride, np.full(blocks.size, page)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    pages = np.diff(np.append(starts, blocks.size))
    return blocks[starts] * stride, rows[starts] + slots[starts] * slot_stride, pages * page


class DmaCopier(Copier):
    """The copy-engine path: the job's merged runs, one batched driver call per job.

    Runs are pages adjacent on both sides (consecutive GPU blocks of a plane whose
    block stride equals its page size, consecutive slots of one pool row); a padded
    or K/V-interleaved plane is copied page by page. With ``batch`` (a
    :class:`~triton_offload.transfer.batch_copy.BatchCopy`) every run of the job goes into one
    ``cuMemcpyBatchAsync``, descriptors built with numpy; without it (a driver before
    12.8) the fallback is one ``api.memcpy_async`` per run. ``mode`` names the path.
    """

    name = "dma"

    def __init__(
        self,
        layout: CacheLayout,
        pool_address: int,
        row_stride: int,
        api: Any,
        batch: BatchCopy | None = None,
        *,
        fallback_reason: str = "",
    ) -> None:
        self.layout = layout
        self.pool_address = pool_address
        self.row_stride = row_stride
        self.api = api
        self.batch = batch
        self.mode = (
            f"batched ({batch.source})"
            if batch is not None
            else (fallback_reason or "per-run cudaMemcpyAsync loop")
        )
        self._builder = DescriptorBuilder(layout, pool_address, row_stride)
        self.descriptor_pool = DescriptorPool()
        self.last_copy_count = 0
        self.last_call_count = 0

    def descriptors(
        self, table: PairTable, direction: int, planes: PlaneSubset
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(targets, sources, lengths) of every merged run of the job: uint64 arrays of
        their own (``prepare`` writes into the copier's reused sets instead).

        The CPU path's runs (same addresses, same merging; see
        :class:`DescriptorBuilder`); a store's slots that another rank writes are left
        out (writer rotation).
        """
        return self._builder.build(DescriptorBuffers(), table, direction, planes)

    def prepare(
        self, table: PairTable, direction: int, planes: PlaneSubset, holds: JobHolds, stream: Any
    ) -> Callable[[], None]:
        hold = self.descriptor_pool.acquire()
        try:
            targets, sources, lengths = self._builder.build(hold.buffers, table, direction, planes)
        except BaseException:
            hold.release()
            raise
        handle = 0 if stream is None else int(stream.cuda_stream)
        count = int(lengths.size)
        batch = self.batch
        if batch is not None:
            # Given back after the driver call (which reads the descriptors during the
            # call), or with the job's holds if the call never runs.
            holds.releases.append(hold.release)

            def run_batch() -> None:
                try:
                    batch(targets, sources, lengths, handle)
                finally:
                    hold.release()
                self.last_copy_count, self.last_call_count = count, int(count > 0)

            return run_batch
        copy = self.api.memcpy_async
        runs = (targets.tolist(), sources.tolist(), lengths.tolist())
        hold.release()

        def run_loop() -> None:
            for target, source, length in zip(*runs, strict=True):
                copy(target, source, length, handle)
            self.last_copy_count = self.last_call_count = count

        return run_loop


# ---------------------------------------------------------------------- the kernel


def load_kernels(backend: str, cuda: bool) -> ModuleType:
    """The launcher module, after checking it can run the caches' device.

    On CPU tensors the kernel needs the Triton interpreter (set before the first
    import); on CUDA caches an interpreted module would dereference device addresses on
    the host. ValueError says which and what to do.
    """
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend {backend!r} on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton_offload.kernels is "
            "imported (or use backend='torch')"
        )
    from triton_offload.kernels import copy_blocks

    if not cuda and not copy_blocks._INTERPRETED:
        raise ValueError(
            f"backend {backend!r} on CPU tensors needs the Triton interpreter, but "
            "triton_offload.kernels.copy_blocks was imported before "
            "TRITON_INTERPRET=1 was set; set it before the first import"
        )
    if cuda and copy_blocks._INTERPRETED:
        raise ValueError(
            f"backend {backend!r} on CUDA caches needs the compiled kernel, but "
            "TRITON_INTERPRET=1 was set when triton_offload.kernels was imported; "
            "unset it (or use backend='dma')"
        )
    return copy_blocks


@dataclass(frozen=True, eq=False)
class KernelTables:
    """The kernel's static tables for some planes of a layout (see ``CopyTables``).

    ``planes`` are the layout's plane indices the tables cover. Groups without such a
    plane keep their row in ``group_table`` with zero tiles per pair, so a job's group
    offsets stay valid for every subset.
    """

    tile_table: torch.Tensor
    group_table: torch.Tensor
    num_groups: int
    pool_row_bytes: int  # the row stride
    mean_tile_bytes: int
    device: torch.device
    planes: tuple[int, ...]
    #: Most bytes of one tile: the tables were cut with it and every launch passes it
    #: as the kernel's ``TILE_BYTES`` (a launch at another size drops or overruns bytes).
    tile_bytes: int


def kernel_tables(
    layout: CacheLayout,
    row_stride: int,
    tile_bytes: int,
    device: torch.device,
    planes: Sequence[int] | None = None,
) -> KernelTables:
    """Cut the given planes (all when None) into tiles of at most ``tile_bytes``; upload.

    ``tile_bytes`` must be a power of two of at least 16 bytes: the kernel copies one
    tile in ``tile_bytes // 16`` lanes of 16 bytes, and a lane count must be a power of
    two (``tl.arange``). ValueError otherwise, before anything is uploaded.
    """
    check_tile_bytes(tile_bytes)
    chosen = tuple(range(len(layout.planes))) if planes is None else tuple(sorted(planes))
    wanted = set(chosen)
    tiles: list[tuple[int, int, int, int, int]] = []
    group_rows: list[tuple[int, int]] = []
    for group in range(layout.num_groups):
        first = len(tiles)
        for index in layout.group_planes[group]:
            if index not in wanted:
                continue
            plane = layout.planes[index]
            for start in range(0, plane.page_bytes, tile_bytes):
                tiles.append(
                    (
                        plane.base_address + start,
                        plane.block_stride,
                        plane.pool_offset + start,
                        plane.pool_slot_stride,
                        min(tile_bytes, plane.page_bytes - start),
                    )
                )
        group_rows.append((len(tiles) - first, first))
    return KernelTables(
        tile_table=torch.tensor(tiles, dtype=torch.int64).reshape(-1, 5).to(device),
        group_table=torch.tensor(group_rows, dtype=torch.int64).reshape(-1, 2).to(device),
        num_groups=layout.num_groups,
        pool_row_bytes=row_stride,
        mean_tile_bytes=sum(t[4] for t in tiles) // len(tiles) if tiles else tile_bytes,
        device=device,
        planes=chosen,
        tile_bytes=tile_bytes,
    )


def gap_tables(
    layout: CacheLayout, row_stride: int, tile_bytes: int, device: torch.device
) -> KernelTables | None:
    """Tables whose tiles are the bytes of each group's row payload between its planes'
    slots (``checksums.gap_ranges``), cut at ``tile_bytes``: a read-only launch over
    them with one pair ``(0, row, 0)`` per page sums those bytes from the pool side (the
    block columns are zero: no cache byte is read). None when no group has such bytes."""
    check_tile_bytes(tile_bytes)
    tiles: list[tuple[int, int, int, int, int]] = []
    group_rows: list[tuple[int, int]] = []
    for ranges in gap_ranges(layout):
        first = len(tiles)
        for offset, length in ranges:
            for start in range(0, length, tile_bytes):
                tiles.append((0, 0, offset + start, 0, min(tile_bytes, length - start)))
        group_rows.append((len(tiles) - first, first))
    if not tiles:
        return None
    return KernelTables(
        tile_table=torch.tensor(tiles, dtype=torch.int64).reshape(-1, 5).to(device),
        group_table=torch.tensor(group_rows, dtype=torch.int64).reshape(-1, 2).to(device),
        num_groups=layout.num_groups,
        pool_row_bytes=row_stride,
        mean_tile_bytes=sum(t[4] for t in tiles) // len(tiles),
        device=device,
        planes=(),
        tile_bytes=tile_bytes,
    )


def check_tile_bytes(tile_bytes: object) -> int:
    """``tile_bytes`` as an int, or ValueError/TypeError naming it (see kernel_tables)."""
    value = check_int("tile_bytes", tile_bytes, 1)
    if value < 16 or value & (value - 1):
        raise ValueError(
            f"tile_bytes {value} must be a power of two of at least 16 bytes (the kernel "
            "copies a tile in tile_bytes // 16 lanes of 16 bytes)"
        )
    return value


def _pinned_int64(numel: int) -> torch.Tensor:
    capacity = 1 << max(10, math.ceil(math.log2(max(numel, 1))))
    return torch.empty(capacity, dtype=torch.int64, pin_memory=True)


def _upload(words: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Enqueue the copy of pinned int64 ``words`` to a new tensor on ``device``.

    On the current stream, without waiting: the staging buffer must stay untouched
    until an event recorded after this copy completed.
    """
    target = torch.empty(words.numel(), dtype=torch.int64, device=device)
    target.copy_(words, non_blocking=True)
    return target


class StagingRing:
    """Pinned int64 buffers for staged tables; each is reused only after its job ended.

    A buffer is free (never used, or its job ended), held (acquired, its release not yet
    registered) or busy (released after an event that has not completed). Busy buffers
    wait in release order: each transfer stream finishes its jobs in submit order, so
    when the oldest busy buffer's event has not completed the newer ones mostly have
    not either, and a job queries that one event only.
    """

    def __init__(self, limit: int = MAX_STAGING_BUFFERS) -> None:
        self.buffers: list[torch.Tensor] = []
        #: The event each buffer was last released after (None: never released).
        self.events: list[Any] = []
        self._free: list[int] = []
        self._busy: deque[int] = deque()
        self.limit = limit

    def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """A buffer of at least ``numel`` words, held until :meth:`release_after`."""
        index = self._take()
        if self.buffers[index].numel() < max(numel, 1):
            self.buffers[index] = _pinned_int64(numel)
        return index, self.buffers[index][:numel]

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        busy = self._busy
        if busy and self._ended(busy[0]):
            return busy.popleft()
        if len(self.buffers) < self.limit:
            self.buffers.append(torch.empty(0, dtype=torch.int64))  # sized by acquire
            self.events.append(None)
            return len(self.buffers) - 1
        if not busy:
            raise RuntimeError(f"all {self.limit} staging buffers are held by unreleased jobs")
        # Every buffer is in use. Stores and loads end independently, so a newer buffer
        # may have ended before the oldest: taking it is cheaper than blocking the host.
        for position in range(1, len(busy)):
            if self._ended(busy[position]):
                index = busy[position]
                del busy[position]
                return index
        index = busy.popleft()
        self.events[index].synchronize()
        return index

    def _ended(self, index: int) -> bool:
        event = self.events[index]
        return event is None or bool(event.query())

    def release_after(self, index: int, event: Any) -> None:
        """Free buffer ``index`` once ``event`` completed (at once for None)."""
        self.events[index] = event
        if event is None:
            self._free.append(index)
        else:
            self._busy.append(index)


def table_layout(num_pairs: int, num_offsets: int) -> tuple[int, int]:
    """(start of the group offsets, total int64 words) of a job's packed table.

    The pairs come first and the group offsets right after them. No padding: the kernel
    is compiled with every argument in ``do_not_specialize`` (an odd pair count does
    not compile a second variant) and reads both tables with scalar int64 loads, which
    need only the 8-byte alignment every word of the buffer has.
    """
    start = 3 * num_pairs
    return start, start + num_offsets


class TritonCopier(Copier):
    """One launch of the copy kernel per job (or per plane subset of a job)."""

    name = "triton"

    def __init__(
        self,
        layout: CacheLayout,
        pool_address: int,
        row_stride: int,
        *,
        device: torch.device,
        cuda: bool,
        num_programs: int | None = None,
        kernels: ModuleType | None = None,
        tile_bytes: int | None = None,
    ) -> None:
        self.kernels = load_kernels(self.name, cuda) if kernels is None else kernels
        #: Tile size the tables are cut at and every launch runs with (the launcher's
        #: ``TILE_BYTES`` unless given: the grid sweep tries others).
        self.tile_bytes = check_tile_bytes(
            self.kernels.TILE_BYTES if tile_bytes is None else tile_bytes
        )
        self.layout = layout
        self.pool_address = pool_address
        self.row_stride = row_stride
        self.device = device
        self.cuda = cuda
        self.num_programs = num_programs
        self.staging = StagingRing()
        # At construction: a plain upload (the engine synchronizes before the first job).
        self.tables = self._tables(None)
        self._subsets: dict[tuple[int, ...], KernelTables] = {}
        self._gap_tables: KernelTables | None = None
        self._gap_tables_built = False
        # Per subset uploaded on a transfer stream (CUDA): the event recorded after its
        # upload, and the handles of the streams already ordered after it.
        self._uploads: dict[tuple[int, ...], tuple[Any, set[int]]] = {}
        #: The keyed page sums' word weights (:meth:`set_page_weights`); None: unkeyed.
        self.page_weights: torch.Tensor | None = None

    def set_page_weights(self, weights: torch.Tensor) -> None:
        """Make every later page-summing launch (``sums=``: fused copies, read-only and
        gap passes) compute ``keyed_wsum64``: word ``j`` of a page weighed by
        ``weights[j]`` read as uint64 (the kernel module's docstring; the weights are a
        seal key's, :mod:`triton_offload.transfer.seal_key`).

        ``weights``: int64, 1-D, contiguous, on this copier's device, with a weight for
        every 32-bit word of the longest row payload (``ceil(max(group_row_bytes) / 4)``)
        so no launch reads past its end. The copier keeps and reads this tensor itself:
        it must not change while jobs run. TypeError/ValueError name the bad value.
        """
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"page weights must be a torch.Tensor, got {type(weights).__name__}")
        if weights.dtype != torch.int64:
            raise ValueError(f"page weights must be int64 (uint64 bits), got {weights.dtype}")
        if weights.dim() != 1:
            raise ValueError(
                f"page weights must be 1-D, got {weights.dim()}-D {tuple(weights.shape)}"
            )
        if not _same_device(weights.device, self.device):
            raise ValueError(f"page weights are on {weights.device}, the copier on {self.device}")
        if not weights.is_contiguous():
            raise ValueError(f"page weights must be contiguous, got stride {weights.stride(0)}")
        words = -(-max(self.layout.group_row_bytes, default=0) // 4)
        if weights.numel() < words:
            raise ValueError(
                f"page weights hold {weights.numel()} words, fewer than the {words} of the "
                f"longest row payload ({max(self.layout.group_row_bytes)} bytes)"
            )
        self.page_weights = weights

    def _tables(self, planes: PlaneSubset) -> KernelTables:
        return kernel_tables(self.layout, self.row_stride, self.tile_bytes, self.device, planes)

    def tables_for(self, planes: PlaneSubset, stream: Any = None) -> KernelTables:
        """Static tables of a plane subset: built once per subset, then reused.

        On CUDA, ``stream`` (default: the current one) is the stream that launches with
        them. Subsets appear while serving (which planes go to the kernel depends on
        the blocks each group has in a job), so a new subset's tables are staged in
        pinned memory and uploaded on ``stream`` without waiting on the host: a
        pageable copy or a synchronize would hold the host until compute reached the
        job. Any other stream that launches with them waits once, on the device, for an
        event recorded after that upload.
        """
        planes = _planes_of(self.layout, planes)
        if planes is None:
            return self.tables
        tables = self._subsets.get(planes)
        if not self.cuda:
            if tables is None:
                tables = self._subsets[planes] = self._tables(planes)
            return tables
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        handle = int(stream.cuda_stream)
        if tables is None:
            tables = self._subsets[planes] = self._upload_tables(planes, stream, handle)
            return tables
        ready, ordered = self._uploads[planes]
        if handle not in ordered:
            stream.wait_event(ready)
            ordered.add(handle)
        return tables

    def _upload_tables(self, planes: tuple[int, ...], stream: Any, handle: int) -> KernelTables:
        staged_tables = kernel_tables(
            self.layout, self.row_stride, self.tile_bytes, torch.device("cpu"), planes
        )
        tiles = staged_tables.tile_table.reshape(-1)
        groups = staged_tables.group_table.reshape(-1)
        index, staged = self.staging.acquire(tiles.numel() + groups.numel())
        try:
            staged[: tiles.numel()] = tiles
            staged[tiles.numel() :] = groups
            words = _upload(staged, self.device)
        except BaseException:
            self.staging.release_after(index, None)  # nothing enqueued reads it
            raise
        ready = torch.cuda.Event()
        ready.record(stream)
        self.staging.release_after(index, ready)
        self._uploads[planes] = (ready, {handle})
        return dataclasses.replace(
            staged_tables,
            tile_table=words[: tiles.numel()].view(-1, 5),
            group_table=words[tiles.numel() :].view(-1, 2),
            device=self.device,
        )

    def gap_tables(self) -> KernelTables | None:
        """This layout's :func:`gap_tables` (built and uploaded on first use: call it
        before jobs run, as the engine does at start-up)."""
        if not self._gap_tables_built:
            self._gap_tables = gap_tables(
                self.layout, self.row_stride, self.tile_bytes, self.device
            )
            self._gap_tables_built = True
        return self._gap_tables

    def prepare_gaps(
        self, table: PairTable, holds: JobHolds, stream: Any, sums: PageSums
    ) -> Callable[[], None] | None:
        """The read-only launch that adds the bytes between each page's slots to
        ``sums`` (``table``: one ``(0, row, 0)`` pair per page); None without such bytes."""
        tables = self.gap_tables()
        if tables is None:
            return None
        return self._prepare_part(table, 1, None, holds, stream, sums, tables)

    def warm_up(self, *, checksum: bool = False) -> None:
        """Compile the kernel before the first job (a launch that moves no byte); with
        ``checksum`` its checksumming variants too: the keyed ones once
        :meth:`set_page_weights` was called (those are what this copier's sums run).

        No kernel argument is specialized, so the one kernel compiled for this device
        serves every later job, whatever its tables, pair count or pool address.
        """
        if checksum and self.page_weights is not None:
            self.kernels.warm_up(self.device, self.tile_bytes, checksum=True, keyed=True)
        elif checksum:
            self.kernels.warm_up(self.device, self.tile_bytes, checksum=True)
        else:
            self.kernels.warm_up(self.device, self.tile_bytes)

    def grid(self, tables: KernelTables) -> int:
        if self.num_programs is not None:
            return self.num_programs
        return int(self.kernels.default_num_programs(self.device, tables.mean_tile_bytes))

    def prepare(
        self,
        table: PairTable,
        direction: int,
        planes: PlaneSubset,
        holds: JobHolds,
        stream: Any,
        *,
        sums: PageSums | None = None,
    ) -> Callable[[], None]:
        """As :meth:`Copier.prepare`; with ``sums`` the launch also adds each page's
        ``wsum64`` (``keyed_wsum64`` after :meth:`set_page_weights`) to ``sums``
        (``sums.write`` False: it only reads, see :class:`PageSums`). Checksummed jobs
        are whole-page jobs: no writer rotation."""
        if sums is not None:
            return self._prepare_part(table, direction, planes, holds, stream, sums)
        launches = [
            self._prepare_part(part, direction, subset, holds, stream)
            for part, subset in writer_parts(
                self.layout, table, direction, _planes_of(self.layout, planes)
            )
        ]

        def run() -> None:
            for launch in launches:
                launch()

        return launches[0] if len(launches) == 1 else run

    def _prepare_part(
        self,
        table: PairTable,
        direction: int,
        planes: PlaneSubset,
        holds: JobHolds,
        stream: Any,
        sums: PageSums | None = None,
        tables: KernelTables | None = None,
    ) -> Callable[[], None]:
        """One launch: ``table`` over ``planes`` (one writer class of a store), or over
        the given ``tables``."""
        if tables is None:
            tables = self.tables_for(planes, stream)
        pairs, offsets = table
        n = pairs.shape[0]
        if self.cuda:
            start, total = table_layout(n, offsets.size)
            extra = 0 if sums is None else n
            index, staged = self.staging.acquire(total + extra)
            # Released after the job's end event, which the engine records even when the
            # job fails: nothing enqueued for the job reads the buffer after it.
            holds.releases.append(lambda event: self.staging.release_after(index, event))
            words = staged.numpy()
            words[: 3 * n] = pairs.reshape(-1)
            words[start:total] = offsets
            if sums is not None:
                words[total : total + n] = sums.pair_pages
            device_table = _upload(staged, self.device)
            holds.keep_alive.append(device_table)
            device_pairs = device_table[: 3 * n].view(n, 3)
            device_offsets = device_table[start:total]
            pair_pages = None if sums is None else device_table[total : total + n]
        else:
            device_pairs = torch.from_numpy(np.ascontiguousarray(pairs))
            device_offsets = torch.from_numpy(np.ascontiguousarray(offsets))
            pair_pages = None if sums is None else torch.from_numpy(sums.pair_pages)
        launch, address, grid = self.kernels.launch_copy, self.pool_address, self.grid(tables)
        if sums is None:

            def run() -> None:
                launch(tables, device_pairs, device_offsets, address, direction, num_programs=grid)

            return run
        page_sums, write = sums.page_sums, sums.write
        # Passed only when keyed, so an unkeyed launch calls the launcher as before.
        keyed = {} if self.page_weights is None else {"page_weights": self.page_weights}

        def run_summed() -> None:
            launch(
                tables,
                device_pairs,
                device_offsets,
                address,
                direction,
                num_programs=grid,
                page_sums=page_sums,
                pair_pages=pair_pages,
                write=write,
                **keyed,
            )

        return run_summed


@dataclass(frozen=True)
class PageSums:
    """Where a launch adds its page checksums: ``page_sums`` (int64 ``[pages]`` on the
    kernel's device, zeroed before the job) at ``pair_pages[i]`` for pair ``i`` (int64
    host array). ``write`` False: a read-only pass over the side the direction reads
    (0: the GPU blocks, 1: the pool), nothing written."""

    page_sums: torch.Tensor
    pair_pages: np.ndarray
    write: bool = True


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        index_a = a.index if a.index is not None else torch.cuda.current_device()
        index_b = b.index if b.index is not None else torch.cuda.current_device()
        return index_a == index_b
    return True


def copy_blocks(
    layout: CacheLayout,
    pairs: Any,
    group_offsets: Any,
    pool: torch.Tensor,
    direction: int,
    *,
    num_programs: int | None = None,
) -> None:
    """Validate a pair table and run it with one kernel launch: the checked entry point.

    For tests and one-off copies (the engine keeps its tables and staging instead).
    ``pool`` is a uint8 ``[rows, >= layout.row_bytes]`` tensor on ``layout.device`` with
    contiguous rows, spaced ``pool.stride(0)`` bytes apart. Raises ValueError/TypeError
    before any byte moves.
    """
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.size(1) < layout.row_bytes:
        raise ValueError(
            f"pool must be a uint8 [rows, >= {layout.row_bytes}] tensor, got {pool.dtype} "
            f"{tuple(pool.shape)}"
        )
    if pool.size(1) > 1 and pool.stride(1) != 1:
        raise ValueError(f"pool rows must be contiguous, got strides {pool.stride()}")
    if pool.size(0) > 1 and pool.stride(0) < pool.size(1):
        raise ValueError(f"pool rows overlap: strides {pool.stride()}, rows of {pool.size(1)}")
    if not _same_device(pool.device, layout.device):
        raise ValueError(f"pool is on {pool.device}, the layout on {layout.device}")
    check_pool_placement(pool, layout)
    validate_pairs(layout, pool.size(0), pairs, group_offsets, direction)
    if num_programs is not None:
        num_programs = check_num_programs(num_programs)
    kernels = load_kernels("triton", layout.device.type == "cuda")
    stride = int(pool.stride(0)) if pool.size(0) > 1 else int(pool.size(1))
    whole = PairTable(_host_table(pairs), _host_table(group_offsets))
    for part, subset in writer_parts(layout, whole, direction, None):
        tables = kernel_tables(layout, stride, kernels.TILE_BYTES, layout.device, subset)
        table = torch.from_numpy(np.ascontiguousarray(part.pairs)).to(layout.device)
        offsets = torch.from_numpy(np.ascontiguousarray(part.offsets)).to(layout.device)
        grid = num_programs
        if grid is None:
            grid = int(kernels.default_num_programs(layout.device, tables.mean_tile_bytes))
        address = pool.data_ptr()
        kernels.launch_copy(
            tables, table.reshape(-1, 3), offsets, address, int(direction), num_programs=grid
        )


def _host_table(values: Any) -> np.ndarray:
    """A validated table (tensor, array or list) as a host int64 array."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


__all__ = [
    "MAX_NUM_PROGRAMS",
    "MAX_STAGING_BUFFERS",
    "Copier",
    "DescriptorBuffers",
    "DescriptorBuilder",
    "DescriptorHold",
    "DescriptorPool",
    "DmaCopier",
    "HostCopier",
    "JobHolds",
    "KernelTables",
    "PageSums",
    "StagingRing",
    "TritonCopier",
    "check_num_programs",
    "check_tile_bytes",
    "copy_blocks",
    "kernel_tables",
    "load_kernels",
    "table_layout",
]
