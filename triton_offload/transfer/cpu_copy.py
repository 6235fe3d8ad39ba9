"""The CPU copy path: cache planes <-> pool rows without CUDA and without Triton.

Why ``memmove`` per page and not numpy/torch indexing: measured on a 2-core x86
machine, 64 MiB moved as random pages out of a plane with a padded block stride
(``bench/suites/bench_cpu_copy.py`` measures the same against one large copy):

==========  ===========  =========================  ==========================  =========
page        large copy   numpy void ``d[i]=s[j]``   same, 512 KiB batches       memmove
==========  ===========  =========================  ==========================  =========
4 KiB       7.2 GB/s     2.7 GB/s                   3.6 GB/s                    3.2 GB/s
16 KiB      7.8 GB/s     2.8 GB/s                   4.0 GB/s                    5.3 GB/s
64 KiB      7.5 GB/s     2.9 GB/s                   4.9 GB/s                    6.7 GB/s
==========  ===========  =========================  ==========================  =========

Fancy indexing with both sides indexed gathers into a temporary and scatters again
(two passes over the bytes); ``torch.index_copy_`` is slower still. A loop of
``ctypes.memmove`` over addresses computed by numpy makes one pass and costs ~0.5 us
per page. The table above was taken with the other core busy; on an idle machine one
large torch ``copy_`` uses both cores (10-13 GB/s) while one memmove stream of random
pages stays near 4 GB/s, so jobs of long runs are split over threads (below):
``bench/suites/bench_cpu_copy.py`` then gave 0.33 of the large copy at 16 KiB and 0.5 at
64 KiB (0.18 at 4 KiB, where the per-call cost dominates).
Driving it with ``map`` instead of a ``for`` loop trims the per-page interpreter work
further (as fast or faster at every page size; 64 KiB pages went from 0.64 to 0.87 of
the large copy in one run).
Contiguous runs (adjacent pages on both sides) are merged into one ``memmove``.

A checksummed job (:func:`copy_and_hash_pages`) hashes each pool row while its bytes are
still in cache: rows are copied and hashed in batches of :data:`HOT_BATCH_BYTES`, each
batch's runs copied, then its rows hashed, instead of the whole job copied and every row
read back from memory afterwards.

All addresses are computed with numpy from the static plane geometry and the pair
table; the caller must have validated the pairs (the copies here trust them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import numpy as np
import torch
import xxhash

from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout

_memmove = ctypes.memmove
_digest = xxhash.xxh3_64_intdigest
T = TypeVar("T")

#: Runs at least this long (mean over the job) are split over several threads:
#: ctypes releases the GIL inside memmove, so threads overlap the copies themselves.
#: Measured on the 2-core CI machine, 64 MiB of random runs, one vs two threads:
#: 16 KiB 3.2 vs 3.5 GB/s (the GIL hand-off per call eats the gain), 32 KiB 4.1 vs
#: 5.7, 64 KiB 3.9 vs 7.2, 256 KiB 4.4 vs 8.9 (one large torch copy_: 10-13 GB/s).
PARALLEL_MIN_RUN_BYTES = 32 << 10
#: ... and only jobs at least this large: waking another thread costs tens of us.
PARALLEL_MIN_JOB_BYTES = 4 << 20
#: Copy threads at most (memory bandwidth, not cores, is the limit beyond a few).
MAX_COPY_THREADS = 4
#: Jobs of at most this many pages are copied page by page with Python ints, without
#: numpy: merging runs saves little on so few pages, and numpy's per-call cost (some 15
#: calls per plane) was most of a 16-page job's time (``bench/suites/bench_small_jobs.py``).
SMALL_JOB_PAGES = 256
#: A checksummed job is copied and hashed a batch of rows at a time, a batch holding about
#: this many payload bytes: small enough to be in the copying core's cache when it is
#: hashed (1 MiB of L2 per core on the CI machine: a batch's source and
#: destination bytes together). XXH3-64 over a 256 KiB row measured
#: 49 GB/s there in cache and 13 GB/s once the row had left it (64 MiB hashed after the
#: copy); ``bench/suites/bench_seal_worker.py`` measures the effect through vLLM's worker.
HOT_BATCH_BYTES = 512 << 10
#: ... unless the rows it names hold at most this many bytes: then the whole job is
#: still in the shared last-level cache (32 MiB here) when its copy ends, and copying
#: it as an unhashed job, then hashing its rows, costs less bookkeeping. Measured here
#: (256-chunk jobs, one thread, rows hashed after the job / in batches, per copy
#: alone): 2 MiB 0.80 / 0.68, 4 MiB 0.74 / 0.69, 8 MiB 0.72 / 0.72, 16 MiB 0.70 / 0.75,
#: 64 MiB 0.68 / 0.79.
COPY_THEN_HASH_BYTES = 4 << 20

_pool_lock = threading.Lock()
_thread_pool: ThreadPoolExecutor | None = None


def copy_threads() -> int:
    """Threads the CPU path may use: torch's intra-op thread count, at most 4.

    Following torch's setting keeps the comparison with a torch ``copy_`` fair (both
    get the same threads) and lets ``torch.set_num_threads(1)`` turn this off too.
    """
    return max(1, min(MAX_COPY_THREADS, torch.get_num_threads()))


def _helpers(count: int) -> ThreadPoolExecutor:
    global _thread_pool
    with _pool_lock:
        if _thread_pool is None:
            _thread_pool = ThreadPoolExecutor(count, thread_name_prefix="triton_offload-copy")
        return _thread_pool


def _memmove_all(targets: list[int], sources: list[int], lengths: list[int]) -> None:
    # map() over the C function keeps the per-run cost to the call itself.
    collections.deque(map(_memmove, targets, sources, lengths), maxlen=0)


class JobRuns(NamedTuple):
    """Every merged run of a job, all planes together (byte addresses and lengths, int64),
    ordered by group, then plane, then pair."""

    targets: np.ndarray
    sources: np.ndarray
    lengths: np.ndarray
    pages: int  # pages the job addresses
    page_bytes: int  # bytes the job moves
    #: The pair (index into the job's pairs) each run starts at, for ``by_row`` runs
    #: (none crosses a pool row), else None.
    first_pairs: np.ndarray | None = None


#: Per group, one ``(cache base, block stride, page bytes, pool offset, pool slot stride)``
#: per plane a job copies: what a small job's copy reads of the layout.
SmallGeometry = tuple[tuple[tuple[int, int, int, int, int], ...], ...]


def _page_geometry(layout: CacheLayout, planes: Sequence[int] | None) -> SmallGeometry:
    wanted = None if planes is None else frozenset(planes)
    return tuple(
        tuple(
            (p.base_address, p.block_stride, p.page_bytes, p.pool_offset, p.pool_slot_stride)
            for p in (layout.planes[i] for i in members if wanted is None or i in wanted)
        )
        for members in layout.group_planes
    )


class RunBuilder:
    """Merged runs of a job with a fixed number of numpy calls per *group*, not per plane.

    The planes of a group are stacked: with ``P`` planes and ``n`` pairs, addresses are
    one ``[P, n]`` array per side, breaks between runs one comparison of neighbours
    along the pairs (every plane row starts a run, so no run crosses planes). The DMA
    path hands the result to one batched driver call; per-plane numpy (merging each
    plane's pages on its own) cost ~10 calls per plane, hundreds per job at 64 planes.
    """

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self._stacks: dict[tuple[int, ...] | None, list[tuple[np.ndarray, ...] | None]] = {}
        self._pages: dict[tuple[int, ...] | None, tuple[SmallGeometry, int]] = {}

    def page_geometry(self, planes: Sequence[int] | None) -> tuple[SmallGeometry, int]:
        """Per group, the chosen planes' ``(cache base, block stride, page bytes, pool
        offset, pool slot stride)`` as Python ints, and the most planes any group has
        (kept per plane subset)."""
        key = None if planes is None else tuple(planes)
        found = self._pages.get(key)
        if found is None:
            geometry = _page_geometry(self.layout, planes)
            found = geometry, max(map(len, geometry), default=0)
            self._pages[key] = found
        return found

    def _stack(self, planes: Sequence[int] | None) -> list[tuple[np.ndarray, ...] | None]:
        key = None if planes is None else tuple(sorted(planes))
        stack = self._stacks.get(key)
        if stack is None:
            wanted = None if key is None else frozenset(key)
            stack = []
            for members in self.layout.group_planes:
                chosen = [self.layout.planes[i] for i in members if wanted is None or i in wanted]
                if not chosen:
                    stack.append(None)
                    continue
                stack.append(
                    tuple(
                        np.array([getattr(p, name) for p in chosen], dtype=np.int64)[:, None]
                        for name in (
                            "base_address",
                            "block_stride",
                            "pool_offset",
                            "page_bytes",
                            "pool_slot_stride",
                        )
                    )
                )
            self._stacks[key] = stack
        return stack

    def runs(
        self,
        pool_address: int,
        pool_row_bytes: int,
        pairs: np.ndarray,
        group_offsets: np.ndarray,
        direction: int,
        planes: Sequence[int] | None = None,
        by_row: bool = False,
    ) -> JobRuns:
        """The job's runs; arguments as for :func:`copy_pages`. ``by_row``: no run crosses
        a pool row, and each run's first pair is returned (``JobRuns.first_pairs``)."""
        assert direction in (Direction.TO_POOL, Direction.FROM_POOL)
        parts: list[tuple[np.ndarray, ...]] = []
        pages = moved = 0
        bounds = group_offsets.tolist()
        for group, stack in enumerate(self._stack(planes)):
            lo, hi = bounds[group], bounds[group + 1]
            if stack is None or lo == hi:
                continue
            base, stride, offset, page, slot_stride = stack
            block = pairs[lo:hi, 0][None, :]
            cache = base + block * stride
            pool = (pool_address + pairs[lo:hi, 1] * pool_row_bytes)[None, :] + (
                offset + pairs[lo:hi, 2][None, :] * slot_stride
            )
            breaks = np.ones(cache.shape, dtype=bool)
            breaks[:, 1:] = (np.diff(cache, axis=1) != page) | (np.diff(pool, axis=1) != page)
            if by_row:
                breaks[:, 1:] |= (np.diff(pairs[lo:hi, 1]) != 0)[None, :]
            starts = np.flatnonzero(breaks)
            counts = np.diff(np.append(starts, cache.size))
            lengths = counts * np.broadcast_to(page, cache.shape).ravel()[starts]
            cache_starts, pool_starts = cache.ravel()[starts], pool.ravel()[starts]
            if direction == Direction.TO_POOL:
                part = (pool_starts, cache_starts, lengths)
            else:
                part = (cache_starts, pool_starts, lengths)
            if by_row:
                # Runs are numbered plane-major: run k starts at pair k % n of the group.
                part += (starts % (hi - lo) + lo,)
            parts.append(part)
            pages += cache.size
            moved += int(page.sum()) * (hi - lo)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return JobRuns(empty, empty, empty, 0, 0, empty if by_row else None)
        if len(parts) == 1:
            columns = list(parts[0])
        else:
            columns = [np.concatenate(column) for column in zip(*parts, strict=True)]
        first_pairs = columns[3] if by_row else None
        return JobRuns(columns[0], columns[1], columns[2], pages, moved, first_pairs)


def copy_pages(
    layout: CacheLayout,
    pool_address: int,
    pool_row_bytes: int,
    pairs: np.ndarray,
    group_offsets: np.ndarray,
    direction: int,
    planes: Sequence[int] | None = None,
    runs: RunBuilder | None = None,
) -> int:
    """Copy every plane page named by ``pairs``; returns the bytes moved.

    ``pairs`` is int64 ``[n, 3]`` (gpu_block, pool_row, slot), ordered by group;
    ``group_offsets`` int64 ``[num_groups + 1]``. ``direction`` is
    ``Direction.TO_POOL`` (store) or ``Direction.FROM_POOL`` (load). ``planes`` limits
    the copy to those plane indices (all when None). Pool row ``r`` starts at
    ``pool_address + r * pool_row_bytes`` (the row stride). ``runs`` is the caller's
    :class:`RunBuilder` for ``layout`` (it keeps the stacked plane geometry between
    jobs). Addresses are host addresses (CPU tensors only).
    """
    builder = RunBuilder(layout) if runs is None else runs
    if pairs.shape[0] <= SMALL_JOB_PAGES:
        geometry, widest = builder.page_geometry(planes)
        bounds = group_offsets.tolist()
        # pairs * the most planes of a group bounds the pages: counted only above the limit.
        if pairs.shape[0] * widest <= SMALL_JOB_PAGES or (
            sum((bounds[g + 1] - bounds[g]) * len(chosen) for g, chosen in enumerate(geometry))
            <= SMALL_JOB_PAGES
        ):
            return _copy_small(
                pool_address, pool_row_bytes, pairs.tolist(), bounds, direction, geometry
            )
    job = builder.runs(pool_address, pool_row_bytes, pairs, group_offsets, direction, planes)
    threads = _threads_for(job)
    if threads > 1:
        # Interleaved shares: every thread gets runs of every plane, so the work is
        # balanced when page sizes differ between planes.
        shares = [
            functools.partial(
                _memmove_all,
                job.targets[i::threads].tolist(),
                job.sources[i::threads].tolist(),
                job.lengths[i::threads].tolist(),
            )
            for i in range(threads)
        ]
        _run_shares(shares)
    else:
        _memmove_all(job.targets.tolist(), job.sources.tolist(), job.lengths.tolist())
    return job.page_bytes


def _threads_for(job: JobRuns) -> int:
    """Threads a job's runs are split over: one unless the job and its runs are long."""
    threads = copy_threads()
    if (
        threads > 1
        and job.lengths.size > 0
        and job.page_bytes >= PARALLEL_MIN_JOB_BYTES
        and job.page_bytes >= PARALLEL_MIN_RUN_BYTES * job.lengths.size
    ):
        return threads
    return 1


def _run_shares(shares: Sequence[Callable[[], T]]) -> list[T]:
    """Run the first share here and the others on helper threads; every share has ended
    when this returns or raises (a helper's error is raised here)."""
    helpers = _helpers(len(shares) - 1)
    futures = [helpers.submit(share) for share in shares[1:]]
    try:
        first = shares[0]()
    except BaseException:
        # Whatever stopped this thread's share (KeyboardInterrupt included), no helper
        # may still be writing when the job is reported failed: its late writes would
        # overwrite a later store into the same rows. Shares not started yet are
        # cancelled; running ones are waited for.
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)
        raise
    # Every share must finish (also when one of them failed) before this returns.
    concurrent.futures.wait(futures)
    return [first, *(future.result() for future in futures)]  # a helper's error fails the job


def _copy_small(
    pool_address: int,
    pool_row_bytes: int,
    rows: list[list[int]],
    bounds: list[int],
    direction: int,
    geometry: SmallGeometry,
) -> int:
    """:func:`copy_pages` for a few pages: one memmove per page, addresses as Python ints."""
    memmove, store, moved = _memmove, direction == Direction.TO_POOL, 0
    for group, chosen in enumerate(geometry):
        part = rows[bounds[group] : bounds[group + 1]]
        if not part:
            continue
        for base, stride, page, pool_offset, slot_stride in chosen:
            pool_base = pool_address + pool_offset
            for block, row, slot in part:
                cache = base + block * stride
                pool = pool_base + row * pool_row_bytes + slot * slot_stride
                if store:
                    memmove(pool, cache, page)
                else:
                    memmove(cache, pool, page)
            moved += page * len(part)
    return moved


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` for a 1-D int64 array, in three numpy calls."""
    ordered = np.sort(values)
    keep = np.empty(ordered.size, dtype=bool)
    keep[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class HashedCopy(NamedTuple):
    """A checksummed job's copy: the bytes it moved, every pool row its pairs name
    (ascending, int64) with the XXH3-64 of the row's payload (its group's row bytes) as
    the copy left it (uint64), and the seconds spent hashing (all threads together)."""

    page_bytes: int
    rows: np.ndarray
    values: np.ndarray
    hash_seconds: float


def pool_bytes(pool_address: int, pool_row_bytes: int, rows: int, row_bytes: int) -> memoryview:
    """A pool of ``rows`` rows (``row_bytes`` used of every ``pool_row_bytes``) as one
    flat run of bytes from its first byte: what :func:`copy_and_hash_pages` hashes. It
    holds no reference to the memory: valid while the pool is."""
    span = max(0, (rows - 1) * pool_row_bytes + row_bytes)
    return memoryview((ctypes.c_ubyte * span).from_address(pool_address)).cast("B")


def copy_and_hash_pages(
    layout: CacheLayout,
    pool_address: int,
    pool_row_bytes: int,
    pairs: np.ndarray,
    group_offsets: np.ndarray,
    direction: int,
    pool: memoryview,
    planes: Sequence[int] | None = None,
    runs: RunBuilder | None = None,
    digest: Callable[[memoryview], int] | None = None,
) -> HashedCopy:
    """:func:`copy_pages`, each pool row the job names hashed (``digest`` of its payload,
    XXH3-64 when None; a seal key's ``keyed_ghash64`` for keyed seals;
    the slots the job does not move included) right after the copies into or out of it,
    while its bytes are in cache: a batch of rows of about :data:`HOT_BATCH_BYTES` is
    copied, then hashed. A store's rows are hashed as written, a load's as read.
    ``pool``: the pool's bytes from ``pool_address`` (:func:`pool_bytes`)."""
    if digest is None:
        digest = _digest
    bounds = group_offsets.tolist()
    payload = layout.group_row_bytes
    if pairs.shape[0] <= SMALL_JOB_PAGES:
        # A few pairs: the rows with Python ints, no numpy call.
        row_group: dict[int, int] = {}
        listed = pairs.tolist()
        for group in range(len(bounds) - 1):
            for _, row, _ in listed[bounds[group] : bounds[group + 1]]:
                row_group[row] = group
        row_list = sorted(row_group)
        lengths = [payload[row_group[row]] for row in row_list]
    elif len(set(payload)) == 1:
        # Every row the same length: the rows alone (np.unique's inverse, which the
        # lengths of mixed groups need, costs more than the sort itself).
        rows = _sorted_unique(pairs[:, 1])
        row_list = rows.tolist()
        lengths = [payload[0]] * len(row_list)
    else:
        rows, pair_rows = np.unique(pairs[:, 1], return_inverse=True)
        row_list = rows.tolist()
        groups = np.repeat(np.arange(len(bounds) - 1, dtype=np.int64), np.diff(group_offsets))
        row_lengths = np.empty(rows.size, dtype=np.int64)
        row_lengths[pair_rows] = np.asarray(payload, np.int64)[groups]
        lengths = row_lengths.tolist()
    if sum(lengths) <= COPY_THEN_HASH_BYTES:
        # The whole job is still in cache when its copy ends: copy it as an unhashed job
        # (fewest runs, least bookkeeping), then hash its rows.
        moved = copy_pages(
            layout, pool_address, pool_row_bytes, pairs, group_offsets, direction, planes, runs
        )
        started = time.perf_counter()
        values = [
            digest(pool[row * pool_row_bytes : row * pool_row_bytes + length])
            for row, length in zip(row_list, lengths, strict=True)
        ]
        seconds = time.perf_counter() - started
        return HashedCopy(moved, np.array(row_list, np.int64), np.array(values, np.uint64), seconds)
    # The batches need every pair's row (its index in ``rows``).
    rows, pair_rows = np.unique(pairs[:, 1], return_inverse=True)
    builder = RunBuilder(layout) if runs is None else runs
    job = builder.runs(
        pool_address, pool_row_bytes, pairs, group_offsets, direction, planes, by_row=True
    )
    assert job.first_pairs is not None
    # Rows cut into batches of about HOT_BATCH_BYTES (a row longer than that is a batch
    # of its own); runs in row order, each batch's runs found by its rows.
    if len(set(lengths)) == 1:
        per_batch = max(1, HOT_BATCH_BYTES // max(1, lengths[0]))
        row_bounds = [*range(0, rows.size, per_batch), rows.size]
    else:
        ends = np.cumsum(lengths)
        batch = (ends - np.asarray(lengths)) // HOT_BATCH_BYTES
        row_bounds = [0, *(np.flatnonzero(np.diff(batch)) + 1).tolist(), rows.size]
    run_row = pair_rows.reshape(-1)[job.first_pairs]
    order = np.argsort(run_row, kind="stable")
    run_bounds = np.searchsorted(run_row[order], row_bounds)
    work = _HashWork(
        job.targets[order].tolist(),
        job.sources[order].tolist(),
        job.lengths[order].tolist(),
        run_bounds.tolist(),
        (rows * pool_row_bytes).tolist(),
        lengths,
        row_bounds,
        pool,
        [0] * rows.size,
        digest,
    )
    batches = len(row_bounds) - 1
    threads = min(_threads_for(job), batches)
    if threads > 1:
        # Each thread takes the next batch not yet taken (one shared iterator: next() on
        # it is atomic under the GIL), so a thread that starts late or runs slower takes
        # fewer and the threads end together; with fixed shares the job waited for its
        # slowest thread (up to ~1.5 ms on 64 MiB loads here).
        batch_queue = iter(range(batches))
        seconds = sum(_run_shares([functools.partial(work.run, batch_queue)] * threads))
    else:
        seconds = work.run(range(batches))
    return HashedCopy(job.page_bytes, rows, np.array(work.values, np.uint64), seconds)


class _HashWork(NamedTuple):
    """A checksummed job's runs and rows in row order, cut into batches: batch ``b`` is
    runs ``run_bounds[b]:run_bounds[b + 1]`` and rows ``row_bounds[b]:row_bounds[b + 1]``
    (row ``r`` at byte ``row_starts[r]`` of ``pool``, ``row_lengths[r]`` bytes)."""

    targets: list[int]
    sources: list[int]
    lengths: list[int]
    run_bounds: list[int]
    row_starts: list[int]
    row_lengths: list[int]
    row_bounds: list[int]
    pool: memoryview
    values: list[int]  # filled in by run(), one slot per row
    digest: Callable[[memoryview], int]

    def run(self, batches: Iterable[int]) -> float:
        """Copy and hash ``batches`` (batch numbers; an iterator may be shared between
        threads, each batch then run by the thread that takes it); returns the seconds
        this thread spent hashing."""
        hashing = 0.0
        # Locals: this loop runs once per batch on every copy thread, under the GIL.
        pool, digest, values, clock = self.pool, self.digest, self.values, time.perf_counter
        targets, sources, run_lengths = self.targets, self.sources, self.lengths
        run_bounds, row_bounds = self.run_bounds, self.row_bounds
        starts, lengths = self.row_starts, self.row_lengths
        for index in batches:
            lo, hi = run_bounds[index], run_bounds[index + 1]
            collections.deque(
                map(_memmove, targets[lo:hi], sources[lo:hi], run_lengths[lo:hi]), maxlen=0
            )
            started = clock()
            first, last = row_bounds[index], row_bounds[index + 1]
            values[first:last] = [
                digest(pool[start : start + length])
                for start, length in zip(starts[first:last], lengths[first:last], strict=True)
            ]
            hashing += clock() - started
        return hashing


__all__ = [
    "COPY_THEN_HASH_BYTES",
    "HOT_BATCH_BYTES",
    "SMALL_JOB_PAGES",
    "HashedCopy",
    "JobRuns",
    "RunBuilder",
    "copy_and_hash_pages",
    "copy_pages",
    "copy_threads",
    "pool_bytes",
]
