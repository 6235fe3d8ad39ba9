"""The memmove CPU path against the plain torch reference, byte for byte."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from tests.helpers import run_oracle
from triton_offload.transfer import cpu_copy
from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import build_layout
from triton_offload.transfer.reference import reference_copy


@pytest.mark.parametrize("subset", [None, (0, 2)])
@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_stacked_runs_equal_the_per_plane_runs(direction: int, subset: tuple | None) -> None:
    """RunBuilder (all planes of a group at once) against plane_runs (one plane at a time)."""
    contiguous = torch.zeros(16, 3, 7, dtype=torch.float16)
    padded = torch.zeros(16, 50, dtype=torch.uint8)[:, 3:40]
    small = torch.zeros(16, 5, dtype=torch.uint8)
    layout = build_layout([[contiguous, padded], [small]], num_groups=2, blocks_per_chunk=4)
    pairs = np.array(
        [[3, 2, 1], [4, 2, 2], [5, 2, 3], [9, 0, 0], [7, 4, 0], [8, 4, 1], [0, 1, 3]],
        dtype=np.int64,
    )
    offsets = np.array([0, 4, 7], dtype=np.int64)
    args = (1 << 40, layout.row_bytes + 32, pairs, offsets, direction, subset)
    stacked = cpu_copy.RunBuilder(layout).runs(*args)
    per_plane = list(run_oracle.plane_runs(layout, *args))
    for name in ("targets", "sources", "lengths"):
        want = np.concatenate([getattr(r, name) for r in per_plane])
        assert getattr(stacked, name).tolist() == want.tolist(), name
    assert stacked.pages == sum(r.pages for r in per_plane)
    assert stacked.page_bytes == sum(r.pages * r.page_bytes for r in per_plane)
    assert stacked.lengths.size < stacked.pages  # the run of group 0 merged


def test_page_runs_merge_pages_adjacent_on_both_sides() -> None:
    cache = np.array([100, 110, 120, 200, 210, 300], dtype=np.int64)
    pool = np.array([0, 10, 20, 30, 45, 55], dtype=np.int64)
    starts_cache, starts_pool, lengths = run_oracle.page_runs(cache, pool, 10)
    # 100-120 / 0-20 merge; 200 follows 120 in the pool but not in the cache; 210 follows
    # 200 in the cache but not in the pool (45 != 40); 300 follows 45 -> 55 in the pool only.
    assert starts_cache.tolist() == [100, 200, 210, 300]
    assert starts_pool.tolist() == [0, 30, 45, 55]
    assert lengths.tolist() == [30, 10, 10, 10]
    empty = run_oracle.page_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), 10)
    assert [a.size for a in empty] == [0, 0, 0]


def random_bytes(tensor: torch.Tensor, seed: int) -> None:
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).clone()


@pytest.mark.parametrize(
    ("threads", "small_pages"),
    [(1, 0), (3, 0), (1, cpu_copy.SMALL_JOB_PAGES)],
    ids=["one-thread", "three-threads", "small-job"],
)
@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_copy_pages_matches_reference(
    direction: int, threads: int, small_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The three ways through copy_pages: merged runs on one thread, the threaded path
    # (thresholds at zero: every job takes it when threads > 1), and the per-page path
    # of small jobs (the job below has 15 pages).
    monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", small_pages)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_RUN_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: threads)
    shares: list[int] = []
    real_memmove_all = cpu_copy._memmove_all

    def counting(targets: list[int], sources: list[int], lengths: list[int]) -> None:
        shares.append(len(targets))
        real_memmove_all(targets, sources, lengths)

    monkeypatch.setattr(cpu_copy, "_memmove_all", counting)
    blocks_per_chunk = 4
    results = []
    for path in ("memmove", "reference"):
        contiguous = torch.empty(16, 3, 7, dtype=torch.float16)  # 42 B pages, runs merge
        padded_storage = torch.empty(16, 50, dtype=torch.uint8)
        padded = padded_storage[:, 3:40]  # 37 B pages, 50 B stride: never merged
        small = torch.empty(16, 5, dtype=torch.uint8)
        for seed, tensor in enumerate((contiguous, padded_storage, small)):
            random_bytes(tensor, seed)
        layout = build_layout(
            [[contiguous, padded], [small]], num_groups=2, blocks_per_chunk=blocks_per_chunk
        )
        pool = torch.randint(
            0,
            256,
            (5, layout.row_bytes),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(9),
        )
        # Group 0: blocks 3,4,5 -> row 2 slots 1..3 (a run), 9 -> row 0 slot 0; group 1.
        pairs = np.array(
            [[3, 2, 1], [4, 2, 2], [5, 2, 3], [9, 0, 0], [7, 4, 0], [8, 4, 1], [0, 1, 3]],
            dtype=np.int64,
        )
        offsets = np.array([0, 4, 7], dtype=np.int64)
        if path == "memmove":
            moved = cpu_copy.copy_pages(
                layout, pool.data_ptr(), layout.row_bytes, pairs, offsets, direction
            )
            assert moved == 4 * (42 + 37) + 3 * 5
            # The threaded path hands one interleaved share of the runs to each thread,
            # the one-thread path all runs at once, the small-job path copies page by page.
            assert len(shares) == (0 if small_pages else threads)
        else:
            reference_copy(
                [plane.view for plane in layout.planes],
                layout,
                torch.from_numpy(pairs),
                torch.from_numpy(offsets),
                pool,
                Direction(direction),
            )
        results.append(
            [pool.clone(), *(storage_bytes(t) for t in (contiguous, padded_storage, small))]
        )
    memmove, reference = results
    assert all(torch.equal(a, b) for a, b in zip(memmove, reference, strict=True))


def _row_hashes(pool: torch.Tensor, layout: Any, pairs: np.ndarray, offsets: np.ndarray) -> dict:
    """The judge: XXH3-64 of each named row's payload (its group's row bytes), read from
    the pool after the copy."""
    hashes = {}
    for group in range(offsets.size - 1):
        for row in pairs[offsets[group] : offsets[group + 1], 1].tolist():
            payload = pool[row, : layout.group_row_bytes[group]].numpy().tobytes()
            hashes[row] = xxhash.xxh3_64_intdigest(payload)
    return hashes


@pytest.mark.parametrize(
    ("threads", "small_pages", "batch_bytes", "whole_bytes"),
    [
        (1, cpu_copy.SMALL_JOB_PAGES, 1 << 20, 1 << 20),
        (1, 0, 1 << 20, 1 << 20),
        (1, 0, 1, 0),
        (1, 0, 300, 0),
        (1, cpu_copy.SMALL_JOB_PAGES, 1, 0),
        (3, 0, 1, 0),
    ],
    ids=[
        "few-pairs-copy-then-hash",
        "copy-then-hash",
        "row-batches",
        "two-row-batches",
        "few-pairs-row-batches",
        "three-threads",
    ],
)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_copy_and_hash_pages_copies_like_the_reference_and_hashes_each_row_after_its_copy(
    direction: int,
    groups: int,
    threads: int,
    small_pages: int,
    batch_bytes: int,
    whole_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every way through: jobs whose rows fit the cache copied whole, then hashed (with
    few pairs: rows found with Python ints), row batches on one or three threads; rows of
    one length (one group) and of two."""
    monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", small_pages)
    monkeypatch.setattr(cpu_copy, "HOT_BATCH_BYTES", batch_bytes)
    monkeypatch.setattr(cpu_copy, "COPY_THEN_HASH_BYTES", whole_bytes)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_RUN_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: threads)
    # Every copy and hash in order: which pool row each touches.
    events: list[tuple[str, int]] = []
    events_lock = threading.Lock()
    row_stride = 0  # set per path below
    pool_start = 0
    real_memmove, real_digest = cpu_copy._memmove, cpu_copy._digest

    def memmove(target: int, source: int, length: int) -> int:
        pool_side = target if direction == Direction.TO_POOL else source
        with events_lock:
            events.append(("copy", (pool_side - pool_start) // row_stride))
        return real_memmove(target, source, length)

    def digest(data: memoryview) -> int:
        with events_lock:
            events.append(("hash", len(events)))
        return real_digest(data)

    results = []
    for path in ("fused", "reference"):
        contiguous = torch.empty(16, 3, 7, dtype=torch.float16)  # 42 B pages, runs merge
        padded_storage = torch.empty(16, 50, dtype=torch.uint8)
        padded = padded_storage[:, 3:40]  # 37 B pages, 50 B stride: never merged
        small = torch.empty(16, 5, dtype=torch.uint8)
        for seed, tensor in enumerate((contiguous, padded_storage, small)):
            random_bytes(tensor, seed)
        planes = [[contiguous, padded], [small]][:groups]
        layout = build_layout(planes, num_groups=groups, blocks_per_chunk=4)
        # Rows spaced wider than they hold (a worker's part of a shared region).
        wide = torch.randint(
            0,
            256,
            (5, layout.row_bytes + 24),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(9),
        )
        pool = wide[:, : layout.row_bytes]
        pairs = np.array(
            [[3, 2, 1], [4, 2, 2], [5, 2, 3], [9, 0, 0], [7, 4, 0], [8, 4, 1], [0, 1, 3]],
            dtype=np.int64,
        )
        offsets = np.array([0, 4, 7], dtype=np.int64)
        if groups == 1:
            pairs, offsets = pairs[:4], offsets[:2]
        named_rows = sorted(set(pairs[:, 1].tolist()))
        if path == "fused":
            row_stride, pool_start = wide.stride(0), pool.data_ptr()
            monkeypatch.setattr(cpu_copy, "_memmove", memmove)
            monkeypatch.setattr(cpu_copy, "_digest", digest)
            flat = cpu_copy.pool_bytes(pool.data_ptr(), row_stride, 5, layout.row_bytes)
            hashed = cpu_copy.copy_and_hash_pages(
                layout, pool.data_ptr(), row_stride, pairs, offsets, direction, flat
            )
            monkeypatch.undo()
            assert hashed.page_bytes == 4 * (42 + 37) + (3 * 5 if groups == 2 else 0)
            assert hashed.rows.tolist() == named_rows
            assert hashed.values.dtype == np.uint64
            assert hashed.hash_seconds >= 0
            sums = dict(zip(hashed.rows.tolist(), hashed.values.tolist(), strict=True))
        else:
            reference_copy(
                [plane.view for plane in layout.planes],
                layout,
                torch.from_numpy(pairs),
                torch.from_numpy(offsets),
                pool,
                Direction(direction),
            )
            assert sums == _row_hashes(pool, layout, pairs, offsets)
        results.append(
            [wide.clone(), *(storage_bytes(t) for t in (contiguous, padded_storage, small))]
        )
    fused, reference = results
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))
    copies = [row for kind, row in events if kind == "copy"]
    assert sorted(set(copies)) == named_rows
    hashes = [i for i, (kind, _) in enumerate(events) if kind == "hash"]
    assert len(hashes) == len(named_rows)
    if whole_bytes:
        # Copied whole, then hashed.
        assert min(hashes) > max(i for i, (kind, _) in enumerate(events) if kind == "copy")
    elif threads == 1 and batch_bytes == 1:
        # One row a batch: each row's copies, then its hash, before the next row's copies.
        rows_in_order = [row for i, (kind, row) in enumerate(events) if kind == "copy"]
        hashed_after = [
            sum(1 for j in hashes if j < i) for i, (kind, _) in enumerate(events) if kind == "copy"
        ]
        # Copies of the k-th row (in row order) come after exactly k hashes.
        order = sorted(set(rows_in_order))
        assert hashed_after == [order.index(row) for row in rows_in_order]
    elif threads == 1:
        assert hashes[0] < max(i for i, (kind, _) in enumerate(events) if kind == "copy")


def test_copy_and_hash_pages_of_an_empty_job_hashes_nothing() -> None:
    small = torch.zeros(4, 8, dtype=torch.uint8)
    layout = build_layout([[small]], num_groups=1, blocks_per_chunk=2)
    pool = torch.zeros(2, layout.row_bytes, dtype=torch.uint8)
    flat = cpu_copy.pool_bytes(pool.data_ptr(), layout.row_bytes, 2, layout.row_bytes)
    hashed = cpu_copy.copy_and_hash_pages(
        layout,
        pool.data_ptr(),
        layout.row_bytes,
        np.zeros((0, 3), np.int64),
        np.array([0, 0], np.int64),
        Direction.TO_POOL,
        flat,
    )
    assert (hashed.page_bytes, hashed.rows.size, hashed.values.size) == (0, 0, 0)


def test_copy_and_hash_threads_take_batches_as_they_free_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread held up in its first batch does not hold back batches of its own: the
    other threads take every remaining batch (each batch run exactly once), and the job's
    bytes and row hashes are those of the copy."""
    monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", 0)
    monkeypatch.setattr(cpu_copy, "HOT_BATCH_BYTES", 1)  # one row a batch
    monkeypatch.setattr(cpu_copy, "COPY_THEN_HASH_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_RUN_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: 3)
    cache = torch.empty(16, 64, dtype=torch.uint8)
    random_bytes(cache, 3)
    layout = build_layout([[cache]], num_groups=1, blocks_per_chunk=1)
    rows = 9
    pool = torch.zeros(rows, layout.row_bytes, dtype=torch.uint8)
    pairs = np.array([[block, block, 0] for block in range(rows)], dtype=np.int64)
    offsets = np.array([0, rows], dtype=np.int64)
    others_done = threading.Event()
    held: list[str] = []
    hashed_by: dict[str, int] = {}
    lock = threading.Lock()

    def digest(data: memoryview) -> int:
        name = threading.current_thread().name
        with lock:
            first = not held
            if first:
                held.append(name)
        if first:
            # Released once every other row is hashed: with fixed shares this thread's
            # later batches would still be waiting for it, and the wait would time out.
            others_done.wait(timeout=60)
        with lock:
            hashed_by[name] = hashed_by.get(name, 0) + 1
            if sum(hashed_by.values()) == rows - 1 and not first:
                others_done.set()
        return xxhash.xxh3_64_intdigest(data)

    flat = cpu_copy.pool_bytes(pool.data_ptr(), layout.row_bytes, rows, layout.row_bytes)
    hashed = cpu_copy.copy_and_hash_pages(
        layout,
        pool.data_ptr(),
        layout.row_bytes,
        pairs,
        offsets,
        Direction.TO_POOL,
        flat,
        digest=digest,
    )
    assert others_done.is_set(), "the held thread's other batches waited for it"
    assert hashed_by[held[0]] == 1 and sum(hashed_by.values()) == rows
    assert torch.equal(pool[:, : cache.shape[1]], cache[:rows])
    assert hashed.rows.tolist() == list(range(rows))
    want = [
        xxhash.xxh3_64_intdigest(pool[r, : layout.group_row_bytes[0]].numpy().tobytes())
        for r in range(rows)
    ]
    assert hashed.values.tolist() == want
