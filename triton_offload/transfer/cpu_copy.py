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

All addresses are computed with numpy from the static plane geometry and the pair
table; the caller must have validated the pairs (the copies here trust them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout

_memmove = ctypes.memmove

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
    ) -> JobRuns:
        """The job's runs; arguments as for :func:`copy_pages`."""
        assert direction in (Direction.TO_POOL, Direction.FROM_POOL)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
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
            starts = np.flatnonzero(breaks)
            counts = np.diff(np.append(starts, cache.size))
            lengths = counts * np.broadcast_to(page, cache.shape).ravel()[starts]
            cache_starts, pool_starts = cache.ravel()[starts], pool.ravel()[starts]
            if direction == Direction.TO_POOL:
                parts.append((pool_starts, cache_starts, lengths))
            else:
                parts.append((cache_starts, pool_starts, lengths))
            pages += cache.size
            moved += int(page.sum()) * (hi - lo)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return JobRuns(empty, empty, empty, 0, 0)
        if len(parts) == 1:
            return JobRuns(*parts[0], pages, moved)
        targets, sources, lengths = (np.concatenate(column) for column in zip(*parts, strict=True))
        return JobRuns(targets, sources, lengths, pages, moved)


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
    bounds = group_offsets.tolist()
    group_planes = layout.group_planes
    if planes is not None:
        wanted = frozenset(planes)
        group_planes = tuple(tuple(i for i in m if i in wanted) for m in group_planes)
    pages = sum(
        (bounds[g + 1] - bounds[g]) * len(members) for g, members in enumerate(group_planes)
    )
    if pages <= SMALL_JOB_PAGES:
        return _copy_small(
            layout, pool_address, pool_row_bytes, pairs.tolist(), bounds, direction, group_planes
        )
    builder = RunBuilder(layout) if runs is None else runs
    job = builder.runs(pool_address, pool_row_bytes, pairs, group_offsets, direction, planes)
    threads = copy_threads()
    if (
        threads > 1
        and job.lengths.size > 0
        and job.page_bytes >= PARALLEL_MIN_JOB_BYTES
        and job.page_bytes >= PARALLEL_MIN_RUN_BYTES * job.lengths.size
    ):
        # Interleaved shares: every thread gets runs of every plane, so the work is
        # balanced when page sizes differ between planes.
        shares = [
            (
                job.targets[i::threads].tolist(),
                job.sources[i::threads].tolist(),
                job.lengths[i::threads].tolist(),
            )
            for i in range(threads)
        ]
        helpers = _helpers(threads - 1)
        futures = [helpers.submit(_memmove_all, *share) for share in shares[1:]]
        try:
            _memmove_all(*shares[0])
        except BaseException:
            # Whatever stopped this thread's share (KeyboardInterrupt included), no
            # helper may still be writing when the job is reported failed: its late
            # writes would overwrite a later store into the same rows. Shares not
            # started yet are cancelled; running ones are waited for.
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            raise
        # Every share must finish (also when one of them failed) before this returns.
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()  # a helper's error fails the job
    else:
        _memmove_all(job.targets.tolist(), job.sources.tolist(), job.lengths.tolist())
    return job.page_bytes


def _copy_small(
    layout: CacheLayout,
    pool_address: int,
    pool_row_bytes: int,
    rows: list[list[int]],
    bounds: list[int],
    direction: int,
    group_planes: tuple[tuple[int, ...], ...],
) -> int:
    """:func:`copy_pages` for a few pages: one memmove per page, addresses as Python ints."""
    memmove, store, moved = _memmove, direction == Direction.TO_POOL, 0
    for group, members in enumerate(group_planes):
        part = rows[bounds[group] : bounds[group + 1]]
        if not part:
            continue
        for index in members:
            plane = layout.planes[index]
            base, stride, page = plane.base_address, plane.block_stride, plane.page_bytes
            pool_base, slot_stride = pool_address + plane.pool_offset, plane.pool_slot_stride
            for block, row, slot in part:
                cache = base + block * stride
                pool = pool_base + row * pool_row_bytes + slot * slot_stride
                if store:
                    memmove(pool, cache, page)
                else:
                    memmove(cache, pool, page)
            moved += page * len(part)
    return moved


__all__ = [
    "SMALL_JOB_PAGES",
    "JobRuns",
    "RunBuilder",
    "copy_pages",
    "copy_threads",
]
