"""Page checksums of a job, computed where its bytes move (see ``transfer.seal``).

A *page* is one pool row: one chunk of one group. A job moves some slots of each page
it names; the checksum covers the whole page's payload (the group's row bytes), so the
slots the job does not move are summed too, from the pool side, by a read-only pass
over exactly those slots (a partial first chunk, a load of the window part of a
sliding-window chunk), and so are the bytes between the planes' slots (alignment
padding; a row reused by another group keeps that group's bytes there), by a read-only
pass over those ranges (:func:`gap_ranges`; none for pages that are multiples of 16
bytes). ``wsum64`` is a sum over byte positions, so the passes' sums add up to
``page_checksum`` of the payload exactly.

On CUDA (and under the Triton interpreter) the sums are ``wsum64``, computed by the
copy kernel in the same pass as the copy, or by a device pass over the GPU blocks
beside a DMA copy; the host reads no payload byte. On the CPU path the host computes
``xxh3_64`` of each page right after its copy, while its bytes are still in cache
(``cpu_copy.copy_and_hash_pages``). With a seal key both are keyed (``keyed_wsum64``,
``keyed_ghash64``: ``transfer.seal_key``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from triton_offload.transfer.jobs import PairTable
from triton_offload.transfer.layout import CacheLayout
from triton_offload.transfer.seal import page_checksums
from triton_offload.transfer.seal_key import SealKey


@dataclass(frozen=True)
class PageChecksums:
    """The checksum of every page a job named: ``rows`` (pool rows, ascending),
    ``values`` (uint64, by ``algorithm``) in the same order."""

    rows: np.ndarray
    values: np.ndarray
    algorithm: str
    #: Seconds the host spent computing them (the CPU path's hash; 0 where the copy
    #: kernel or a device pass summed the bytes): part of the job's verification time.
    seconds: float = 0.0


@dataclass(frozen=True)
class JobPages:
    """The pages of one job, as the checksum passes need them.

    ``rows``: the job's pool rows, ascending; ``pair_pages``: for each pair of the job's
    table, the index of its row in ``rows``; ``rest``: the slots of those rows the job
    does not move (gpu block 0: only the pool side is read) with ``rest_pages``, their
    rows' indices.
    """

    rows: np.ndarray
    pair_pages: np.ndarray
    rest: PairTable
    rest_pages: np.ndarray
    #: One pair ``(0, row, 0)`` per page, ordered by group, for the pass over the bytes
    #: of each row between its planes' slots (``gap_tables``), and their pages.
    whole: PairTable
    whole_pages: np.ndarray


def job_pages(layout: CacheLayout, table: PairTable) -> JobPages:
    """The pages of a validated job and the slots of them it leaves out."""
    pairs, offsets = table
    bpc = layout.blocks_per_chunk
    rows, pair_pages = np.unique(pairs[:, 1], return_inverse=True)
    pair_pages = pair_pages.reshape(-1).astype(np.int64)
    # Which (page, slot) the job moves; a page belongs to one group (a row holds one
    # chunk of one group), so the slots left out are per page.
    moved = np.zeros((rows.size, bpc), dtype=bool)
    moved[pair_pages, pairs[:, 2]] = True
    num_groups = offsets.size - 1
    group_of_pair = np.repeat(np.arange(num_groups, dtype=np.int64), np.diff(offsets))
    page_group = np.zeros(rows.size, dtype=np.int64)
    page_group[pair_pages] = group_of_pair
    page_index, slot = np.nonzero(~moved)
    order = np.argsort(page_group[page_index], kind="stable")
    page_index, slot = page_index[order], slot[order]
    rest_pairs = np.stack(
        [np.zeros(page_index.size, np.int64), rows[page_index], slot.astype(np.int64)], axis=1
    )
    rest_offsets = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(page_group[page_index], minlength=num_groups), out=rest_offsets[1:])
    by_group = np.argsort(page_group, kind="stable")
    whole_pairs = np.zeros((rows.size, 3), dtype=np.int64)
    whole_pairs[:, 1] = rows[by_group]
    whole_offsets = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(page_group, minlength=num_groups), out=whole_offsets[1:])
    return JobPages(
        rows.astype(np.int64),
        pair_pages,
        PairTable(np.ascontiguousarray(rest_pairs), rest_offsets),
        page_index.astype(np.int64),
        PairTable(whole_pairs, whole_offsets),
        by_group.astype(np.int64),
    )


def gap_ranges(layout: CacheLayout) -> list[list[tuple[int, int]]]:
    """Per group, the ``(offset, length)`` ranges of its row payload (the first
    ``group_row_bytes[g]`` bytes) that no plane's slot covers: alignment padding between
    planes and slots. No job writes them, but a row reused by another group keeps that
    group's bytes there, and the seal's checksum covers the whole payload."""
    gaps: list[list[tuple[int, int]]] = []
    bpc = layout.blocks_per_chunk
    for group in range(layout.num_groups):
        covered = np.zeros(layout.group_row_bytes[group], dtype=bool)
        for index in layout.group_planes[group]:
            plane = layout.planes[index]
            for slot in range(bpc):
                start = plane.pool_offset + slot * plane.pool_slot_stride
                covered[start : start + plane.page_bytes] = True
        edges = np.flatnonzero(np.diff(np.concatenate([[True], covered, [True]]).astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        gaps.append([(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)])
    return gaps


def page_groups(table: PairTable, rows: np.ndarray) -> np.ndarray:
    """The group of each of ``rows`` (the job's pages, ascending) in a job's table."""
    pairs, offsets = table
    num_groups = offsets.size - 1
    group_of_pair = np.repeat(np.arange(num_groups, dtype=np.int64), np.diff(offsets))
    groups = np.zeros(rows.size, dtype=np.int64)
    groups[np.searchsorted(rows, pairs[:, 1])] = group_of_pair
    return groups


def host_checksums(
    pool: np.ndarray,
    layout: CacheLayout,
    table: PairTable,
    algorithm: str,
    seal_key: SealKey | None = None,
) -> PageChecksums:
    """The CPU path: each page's checksum computed here from the pool's bytes (the
    group's row bytes of every row the job named)."""
    started = time.perf_counter()
    rows = np.unique(table.pairs[:, 1]).astype(np.int64)
    lengths = np.asarray(layout.group_row_bytes, dtype=np.int64)[page_groups(table, rows)]
    values = page_checksums(pool, rows, lengths, algorithm, seal_key)
    return PageChecksums(rows, values, algorithm, time.perf_counter() - started)


__all__ = [
    "JobPages",
    "PageChecksums",
    "gap_ranges",
    "host_checksums",
    "job_pages",
    "page_groups",
]
