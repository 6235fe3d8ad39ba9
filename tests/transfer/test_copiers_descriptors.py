"""The DMA path's descriptors against a judge written from the rules, no GPU.

Rules (``DescriptorBuilder``): page ``(group, plane, pair)`` of a job is the cache
address ``base + block * block_stride`` and the pool address ``pool_address + row *
row_stride + pool_offset + slot * slot_stride``, ``page_bytes`` long; a store's source
is the cache, a load's the pool. A store leaves out the slots another rank writes (row
page ``row * blocks_per_chunk + slot`` not ``writer_index`` modulo ``num_writers``) and
goes writer class by writer class (sorted); within it, group by group, plane by plane,
pair by pair. Consecutive pages of one plane form one run while both sides are exactly
one page further; the runs are what the driver gets.

The judge walks the pages one by one with Python ints. Layouts are random: several
groups, planes of mixed strides in one group (several run patterns), padded blocks,
fragment planes (slot stride above the page), writer rotation, pools with wider rows,
one plane filling its row (runs across rows). Addresses are made up: nothing is copied,
the driver stand-in only reads what it is given.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from triton_offload.transfer import batch_copy
from triton_offload.transfer.copiers import DescriptorBuffers, DmaCopier, JobHolds
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec, PairTable, pair_table
from triton_offload.transfer.layout import POOL_ALIGNMENT, CacheLayout, Plane

Run = tuple[int, int, int]  # (target, source, bytes)
POOL_ROWS = 192
POOL_ADDRESS = 1 << 44
PLANE_SPAN = 1 << 24  # address space of each made-up plane


def random_layout(rng: np.random.Generator) -> tuple[CacheLayout, int]:
    """A random layout and a row stride for it (at least its row bytes)."""
    bpc = int(rng.integers(1, 5))
    num_groups = int(rng.integers(1, 4))
    whole_row = rng.random() < 0.2  # one plane filling its row: runs go across rows
    planes: list[Plane] = []
    row_bytes = 0
    for group in range(num_groups):
        count = 1 if whole_row else int(rng.integers(0 if group else 1, 6))
        offset = 0
        for layer in range(count):
            page = int(rng.choice([16, 48, 100, 256]))
            stride = page if rng.random() < 0.6 else page + int(rng.integers(1, 64))
            slot_stride = page if whole_row or rng.random() < 0.7 else page + 16
            writers = 1 if whole_row or rng.random() < 0.6 else int(rng.integers(2, 4))
            offset = -(-offset // POOL_ALIGNMENT) * POOL_ALIGNMENT
            planes.append(
                Plane(
                    group=group,
                    base_address=(1 << 36) + len(planes) * PLANE_SPAN,
                    block_stride=stride,
                    page_bytes=page,
                    num_blocks=64,
                    pool_offset=offset,
                    layer=layer,
                    slot_stride=None if slot_stride == page else slot_stride,
                    num_writers=writers,
                    writer_index=int(rng.integers(0, writers)),
                )
            )
            offset += (bpc - 1) * slot_stride + page
        row_bytes = max(row_bytes, offset)
    layout = CacheLayout.from_planes(
        planes,
        num_groups=num_groups,
        blocks_per_chunk=bpc,
        row_bytes=max(row_bytes, 1),
        device="cpu",
    )
    wider = 0 if whole_row or rng.random() < 0.5 else int(rng.integers(1, 4)) * 16
    return layout, max(row_bytes, 1) + wider


def random_job(
    rng: np.random.Generator, layout: CacheLayout, direction: int, max_blocks: int
) -> PairTable:
    """Blocks in runs of consecutive ids, host rows consecutive or shuffled (each group
    in its own band of rows: the groups' planes share row bytes)."""
    bpc = layout.blocks_per_chunk
    band = POOL_ROWS // layout.num_groups
    gpu, host, first = [], [], []
    for group in range(layout.num_groups):
        n = int(rng.integers(0, max_blocks + 1))
        starts = rng.permutation(64 // 8)[: -(-n // 8) + 1] * 8
        blocks = np.concatenate(
            [np.arange(s, s + int(rng.integers(1, 9))) for s in starts] + [np.zeros(0, int)]
        )[:n]
        n = blocks.size
        start = int(rng.integers(0, bpc))
        rows = -(-(start + n) // bpc)
        if rng.random() < 0.5:
            first_row = int(rng.integers(0, band - rows + 1))
            hosts = group * band + np.arange(first_row, first_row + rows)
        else:
            hosts = group * band + rng.permutation(band)[:rows]
        gpu.append(blocks)
        host.append(hosts if n else np.zeros(0, int))
        first.append(start)
    return pair_table(layout, POOL_ROWS, JobSpec(gpu, host, first), direction)


def judge(
    layout: CacheLayout,
    row_stride: int,
    table: PairTable,
    direction: int,
    planes: tuple[int, ...] | None,
) -> list[Run]:
    """The job's runs, page by page from the rules above."""
    pairs, offsets = table.pairs.tolist(), table.offsets.tolist()
    chosen = set(range(len(layout.planes)) if planes is None else planes)
    store = direction == TO_POOL
    bpc = layout.blocks_per_chunk
    classes: list[tuple[int, int] | None] = [None]
    if store:
        classes = sorted({(p.num_writers, p.writer_index) for p in layout.planes})
    runs: list[Run] = []
    for writer_class in classes:
        for group in range(layout.num_groups):
            for index in layout.group_planes[group]:
                plane = layout.planes[index]
                if index not in chosen:
                    continue
                if writer_class is not None and writer_class != (
                    plane.num_writers,
                    plane.writer_index,
                ):
                    continue
                current: list[int] | None = None  # [cache, pool, bytes]
                for block, row, slot in pairs[offsets[group] : offsets[group + 1]]:
                    if store and (row * bpc + slot) % plane.num_writers != plane.writer_index:
                        continue
                    cache = plane.base_address + block * plane.block_stride
                    pool = (
                        POOL_ADDRESS
                        + row * row_stride
                        + plane.pool_offset
                        + slot * plane.pool_slot_stride
                    )
                    if (
                        current is not None
                        and cache == current[0] + current[2]
                        and pool == current[1] + current[2]
                    ):
                        current[2] += plane.page_bytes
                        continue
                    if current is not None:
                        runs.append(_oriented(current, store))
                    current = [cache, pool, plane.page_bytes]
                if current is not None:
                    runs.append(_oriented(current, store))
    return runs


def _oriented(run: list[int], store: bool) -> Run:
    cache, pool, length = run
    return (pool, cache, length) if store else (cache, pool, length)


def as_runs(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[Run]:
    targets, sources, lengths = arrays
    for array in arrays:
        assert array.dtype == np.uint64 and array.flags.c_contiguous
    return list(zip(targets.tolist(), sources.tolist(), lengths.tolist(), strict=True))


class Recorder:
    """cuMemcpyBatchAsync's nine arguments in; the descriptors it was given recorded (read
    through the pointers, as a driver reads them), nothing copied."""

    def __init__(self) -> None:
        self.calls: list[list[Run]] = []
        self.pointers: list[tuple[int, int, int]] = []

    def __call__(self, dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, fail, stream) -> int:
        def array(pointer: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(pointer))

        self.calls.append(list(zip(array(dsts), array(srcs), array(sizes), strict=True)))
        self.pointers.append((dsts, srcs, sizes))
        return 0


def batched_copier(layout: CacheLayout, row_stride: int, recorder: Recorder) -> DmaCopier:
    return DmaCopier(
        layout, POOL_ADDRESS, row_stride, api=None, batch=batch_copy.stand_in(recorder)
    )


def random_subset(rng: np.random.Generator, layout: CacheLayout) -> tuple[int, ...] | None:
    if rng.random() < 0.5:
        return None
    count = len(layout.planes)
    chosen = sorted(rng.choice(count, size=int(rng.integers(1, count + 1)), replace=False))
    return tuple(int(i) for i in chosen)


@pytest.mark.parametrize("seed", range(40))
def test_descriptors_are_the_judges_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layout, row_stride = random_layout(rng)
    copier = DmaCopier(layout, POOL_ADDRESS, row_stride, api=None)
    for direction in (TO_POOL, FROM_POOL):
        table = random_job(rng, layout, direction, max_blocks=40)
        planes = random_subset(rng, layout)
        expected = judge(layout, row_stride, table, direction, planes)
        assert as_runs(copier.descriptors(table, direction, planes)) == expected


def test_the_random_layouts_reach_every_case() -> None:
    """The layouts above hold what the judge is meant to check: groups with several
    plane geometries, merged runs, runs across rows, writer rotation."""
    several, merged, across, rotated = False, False, False, False
    for seed in range(40):
        rng = np.random.default_rng(seed)
        layout, row_stride = random_layout(rng)
        for members in layout.group_planes:
            shapes = {(layout.planes[i].block_stride, layout.planes[i].page_bytes) for i in members}
            several |= len(shapes) > 1
        rotated |= any(p.num_writers > 1 for p in layout.planes)
        for direction in (TO_POOL, FROM_POOL):
            table = random_job(rng, layout, direction, max_blocks=40)
            random_subset(rng, layout)
            runs = judge(layout, row_stride, table, direction, None)
            pages = {p.page_bytes for p in layout.planes}
            merged |= any(length not in pages for *_, length in runs)
            across |= (
                any(
                    length > layout.blocks_per_chunk * layout.planes[0].page_bytes
                    for *_, length in runs
                )
                and len(layout.planes) == 1
            )
    assert several and merged and across and rotated


def test_a_reused_set_keeps_no_entry_of_a_larger_job() -> None:
    """One copier, one set reused: a big job, then small ones, each exactly its runs."""
    rng = np.random.default_rng(7)
    layout, row_stride = random_layout(rng)
    while len(layout.planes) < 3:
        layout, row_stride = random_layout(rng)
    recorder = Recorder()
    copier = batched_copier(layout, row_stride, recorder)
    sizes = [40, 3, 1, 40, 0, 12]
    expected = []
    for number, blocks in enumerate(sizes):
        direction = (TO_POOL, FROM_POOL)[number % 2]
        table = random_job(rng, layout, direction, max_blocks=blocks)
        expected.append(judge(layout, row_stride, table, direction, None))
        holds = JobHolds()
        copier.prepare(table, direction, None, holds, None)()
        holds.release_after(None)
    # An empty job makes no driver call.
    assert recorder.calls == [runs for runs in expected if runs]


def test_the_same_buffer_set_serves_job_after_job() -> None:
    """Buffers are allocated once: a job no larger than the last hands the driver the
    same memory; a set comes back once its call returned, or with the job's holds when
    its call never ran."""
    rng = np.random.default_rng(3)
    layout, row_stride = random_layout(rng)
    recorder = Recorder()
    copier = batched_copier(layout, row_stride, recorder)
    pool = copier.descriptor_pool
    big = random_job(rng, layout, TO_POOL, max_blocks=40)
    small = random_job(rng, layout, TO_POOL, max_blocks=8)
    for table in (big, small, big):
        holds = JobHolds()
        run = copier.prepare(table, TO_POOL, None, holds, None)
        assert (pool.held, pool.free) == (1, 0)
        run()
        assert (pool.held, pool.free) == (0, 1)
        holds.release_after(None)
    assert len(set(recorder.pointers)) == 1
    holds = JobHolds()
    copier.prepare(big, TO_POOL, None, holds, None)  # its call never runs
    assert pool.held == 1
    holds.release_after(None)
    assert (pool.held, pool.free) == (0, 1)
    buffers = DescriptorBuffers()
    buffers.reserve(10)
    first, capacity = buffers.targets.ctypes.data, buffers.capacity
    buffers.reserve(capacity)
    assert buffers.targets.ctypes.data == first
    buffers.reserve(capacity + 1)
    assert buffers.capacity >= 2 * capacity


def test_jobs_prepared_before_their_calls_hold_their_own_descriptors() -> None:
    """A layer-staged load prepares every stage of every job before the first call:
    each prepared call must still send its own job's runs."""
    rng = np.random.default_rng(11)
    layout, row_stride = random_layout(rng)
    recorder = Recorder()
    copier = batched_copier(layout, row_stride, recorder)
    holds = JobHolds()
    prepared, expected = [], []
    for blocks in (40, 6, 25, 40):
        table = random_job(rng, layout, FROM_POOL, max_blocks=blocks)
        planes = random_subset(rng, layout)
        prepared.append(copier.prepare(table, FROM_POOL, planes, holds, None))
        expected.append(judge(layout, row_stride, table, FROM_POOL, planes))
    for run in reversed(prepared):
        run()
    holds.release_after(None)
    assert recorder.calls == [runs for runs in reversed(expected) if runs]


def test_two_lanes_preparing_at_once_each_send_their_own_runs() -> None:
    """The store and load lanes prepare and call on their own threads (the engine's CPU
    path holds one copy lock per lane): two threads, one copier, every call exact."""
    rng = np.random.default_rng(5)
    layout, row_stride = random_layout(rng)
    jobs = []
    for number in range(24):
        direction = (TO_POOL, FROM_POOL)[number % 2]
        table = random_job(rng, layout, direction, max_blocks=int(rng.integers(1, 41)))
        jobs.append((table, direction, judge(layout, row_stride, table, direction, None)))
    sent: dict[int, list[list[Run]]] = {0: [], 1: []}
    lane = threading.local()

    def record(dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, fail, stream) -> int:
        def array(pointer: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(pointer))

        sent[lane.number].append(list(zip(array(dsts), array(srcs), array(sizes), strict=True)))
        return 0

    copier = DmaCopier(
        layout, POOL_ADDRESS, row_stride, api=None, batch=batch_copy.stand_in(record)
    )
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(number: int) -> None:
        lane.number = number
        try:
            barrier.wait(timeout=60)
            for _ in range(20):
                for table, direction, _ in jobs[number::2]:
                    holds = JobHolds()
                    copier.prepare(table, direction, None, holds, None)()
                    holds.release_after(None)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for number in (0, 1):
        wanted = [runs for _, _, runs in jobs[number::2] if runs] * 20
        assert sent[number] == wanted


def test_the_loop_fallback_sends_the_same_runs() -> None:
    """Without the batched call (drivers before 12.8) the runs go one call each."""
    rng = np.random.default_rng(9)
    layout, row_stride = random_layout(rng)
    calls: list[Run] = []

    class Api:
        def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
            calls.append((dst, src, size))

    copier = DmaCopier(layout, POOL_ADDRESS, row_stride, api=Api())
    for number in range(6):
        direction = (TO_POOL, FROM_POOL)[number % 2]
        table = random_job(rng, layout, direction, max_blocks=40)
        calls.clear()
        copier.prepare(table, direction, None, JobHolds(), None)()
        assert calls == judge(layout, row_stride, table, direction, None)
        assert copier.last_call_count == len(calls)
    assert copier.descriptor_pool.held == 0


def test_descriptors_returned_by_the_copier_stay_its_callers() -> None:
    """``descriptors()`` hands out arrays of their own: a later job leaves them intact."""
    rng = np.random.default_rng(13)
    layout, row_stride = random_layout(rng)
    copier = DmaCopier(layout, POOL_ADDRESS, row_stride, api=None)
    table = random_job(rng, layout, TO_POOL, max_blocks=40)
    first = copier.descriptors(table, TO_POOL, None)
    kept = as_runs(first)
    copier.descriptors(random_job(rng, layout, FROM_POOL, max_blocks=40), FROM_POOL, None)
    assert as_runs(first) == kept == judge(layout, row_stride, table, TO_POOL, None)


def test_a_job_ending_after_its_call_gives_back_only_its_own_set() -> None:
    """Job A's call returns (its set goes back), job B takes that set, then A's holds are
    released: B's set must stay B's, so job C, prepared before B's call, gets another."""
    rng = np.random.default_rng(17)
    layout, row_stride = random_layout(rng)
    recorder = Recorder()
    copier = batched_copier(layout, row_stride, recorder)
    tables = [random_job(rng, layout, TO_POOL, max_blocks=40) for _ in range(3)]
    expected = [judge(layout, row_stride, table, TO_POOL, None) for table in tables]
    holds = [JobHolds() for _ in tables]
    copier.prepare(tables[0], TO_POOL, None, holds[0], None)()
    run_b = copier.prepare(tables[1], TO_POOL, None, holds[1], None)
    holds[0].release_after(None)
    assert copier.descriptor_pool.held == 1  # B's
    run_c = copier.prepare(tables[2], TO_POOL, None, holds[2], None)
    run_b()
    run_c()
    assert recorder.calls == expected
