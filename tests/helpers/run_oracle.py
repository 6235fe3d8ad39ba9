"""Test oracle for :class:`triton_offload.transfer.cpu_copy.RunBuilder`: the same merged runs,
computed one plane at a time with plain numpy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout


def page_runs(
    cache_addresses: np.ndarray, pool_addresses: np.ndarray, page_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pages adjacent on both sides: (cache starts, pool starts, byte lengths)."""
    n = cache_addresses.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.ones(n, dtype=bool)
    if n > 1:
        breaks[1:] = (np.diff(cache_addresses) != page_bytes) | (
            np.diff(pool_addresses) != page_bytes
        )
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.append(starts, n)) * page_bytes
    return cache_addresses[starts], pool_addresses[starts], lengths


class PlaneRuns(NamedTuple):
    """The merged runs of one plane in one job (byte addresses and lengths)."""

    page_bytes: int
    pages: int  # pages of this plane the job addresses
    targets: np.ndarray  # int64 destination address of each run
    sources: np.ndarray  # int64 source address of each run
    lengths: np.ndarray  # int64 bytes of each run


def plane_runs(
    layout: CacheLayout,
    pool_address: int,
    pool_row_bytes: int,
    pairs: np.ndarray,
    group_offsets: np.ndarray,
    direction: int,
    planes: Sequence[int] | None = None,
) -> Iterator[PlaneRuns]:
    """Per plane of every group the job addresses, its pages merged into runs.

    ``pairs`` / ``group_offsets`` / ``direction`` / ``planes`` as in
    :func:`triton_offload.transfer.cpu_copy.copy_pages`; ``pool_address`` is the address of
    pool row 0 as the copies will see it, ``pool_row_bytes`` the row stride. Work is numpy over the
    pairs, once per plane.
    """
    assert direction in (Direction.TO_POOL, Direction.FROM_POOL)
    store = direction == Direction.TO_POOL
    wanted = None if planes is None else frozenset(planes)
    for group in range(layout.num_groups):
        lo, hi = int(group_offsets[group]), int(group_offsets[group + 1])
        if lo == hi:
            continue
        blocks = pairs[lo:hi, 0]
        row_starts = pool_address + pairs[lo:hi, 1] * pool_row_bytes
        slots = pairs[lo:hi, 2]
        for index in layout.group_planes[group]:
            if wanted is not None and index not in wanted:
                continue
            plane = layout.planes[index]
            page = plane.page_bytes
            cache = plane.base_address + blocks * plane.block_stride
            pool = row_starts + plane.pool_offset + slots * page
            cache_starts, pool_starts, lengths = page_runs(cache, pool, page)
            if store:
                yield PlaneRuns(page, hi - lo, pool_starts, cache_starts, lengths)
            else:
                yield PlaneRuns(page, hi - lo, cache_starts, pool_starts, lengths)
