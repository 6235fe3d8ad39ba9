"""TransferEngine on a GPU: pinned pool, stream ordering, Triton vs DMA, calibration.

All tests are marked ``cuda`` (skipped with a reason without a GPU) and run in
``bench/gpu_check.sh``. Sizes are small: the point is ordering and exactness.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from triton_offload import GroupSpec, ParallelSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine

pytestmark = pytest.mark.cuda

NUM_BLOCKS = 16
HOST_BLOCKS = 12


def plan(blocks_per_chunk: int = 2) -> Any:
    groups = [
        GroupSpec("full_attention", 16),
        GroupSpec("sliding_window", 16, sliding_window=64),
        GroupSpec("mamba", 16, mamba_cache_mode="align"),
    ]
    return plan_offload(
        groups, ParallelSpec(tp_size=2, dcp_size=2), blocks_per_chunk=blocks_per_chunk
    )


def random_fill(tensor: torch.Tensor, seed: int) -> None:
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def hybrid_caches(seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    device = torch.device("cuda")
    kv = torch.empty(2, NUM_BLOCKS, 16, 4, 64, dtype=torch.bfloat16, device=device)  # 8 KiB
    padded = torch.empty(NUM_BLOCKS, 16 * 4 * 32 + 24, dtype=torch.float16, device=device)
    window = padded[:, 8 : 8 + 16 * 4 * 32].unflatten(1, (16, 4, 32))  # 4 KiB, stride +48 B
    conv = torch.empty(NUM_BLOCKS, 3, 45, dtype=torch.float16, device=device)  # 270 B
    ssm = torch.empty(NUM_BLOCKS, 8, 64, 33, dtype=torch.float32, device=device)  # ~66 KiB
    storages = [kv, padded, conv, ssm]
    for index, tensor in enumerate(storages):
        random_fill(tensor, seed + index)
    return [[(kv[0], kv[1])], [window], [(conv, ssm)]], storages


def host_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for tensor in tensors:
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        out.append(raw.set_(tensor.untyped_storage()).to("cpu", copy=True))
    return out


#: Seconds drain() waits for jobs: a job that never completes fails its test instead of
#: spinning until the step's time limit kills the whole file (a CUDA synchronize cannot
#: be interrupted by pytest-timeout's signal; get_finished only polls events). The jobs
#: here move well under 1 MB (milliseconds); 30 s means a hang, not a slow job.
DRAIN_SECONDS = 30.0


def drain(engine: TransferEngine, count: int, seconds: float = DRAIN_SECONDS) -> list:
    deadline = time.monotonic() + seconds
    results: list = engine.get_finished()
    while len(results) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(results)} of {count} jobs finished within {seconds} s")
        time.sleep(0.0005)
        results += engine.get_finished()
    return results


def assert_page_locked(engine: TransferEngine) -> None:
    """The pool is page-locked from its first to its last byte with one linear device
    mapping, as CUDA reports it (torch 2.11's ``is_pinned()`` answers False for memory
    locked with cudaHostRegister, so it cannot be the judge)."""
    from triton_offload.transfer.pool import cuda_api

    pool = engine.pool
    last = (pool.size(0) - 1) * engine._pool.row_stride + pool.size(1) - 1
    assert engine._pool.pinned
    assert engine.pool_address == cuda_api().device_pointer(pool.data_ptr())
    assert cuda_api().device_pointer(pool.data_ptr() + last) == engine.pool_address + last


STORE = ([[3, 9, 4], [0, 15], [7]], [[2, 5], [11, 10], [8]], [1, 1, 0])
LOAD_TARGETS = [[1, 2, 10], [6, 8], [12]]


@pytest.mark.parametrize("backend", ["triton", "dma", "auto"])
def test_round_trip(backend: str) -> None:
    caches, storages = hybrid_caches()
    kwargs = {"crossover": 32 << 10} if backend == "auto" else {}  # configured: no calibration
    engine = TransferEngine(plan(), caches, HOST_BLOCKS, backend=backend, **kwargs)
    assert_page_locked(engine)
    engine.pool.copy_(torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8))
    pool_before = engine.pool.clone()
    before = host_bytes(storages)

    gpu, host, first = STORE
    assert engine.submit_store("s", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
    engine.wait(["s"])
    (result,) = drain(engine, 1)
    assert result.success and result.transfer_time > 0
    expected_size = sum(
        len(blocks) * engine.layout.bytes_per_block[g] for g, blocks in enumerate(gpu)
    )
    assert result.transfer_size == expected_size
    assert all(torch.equal(a, b) for a, b in zip(host_bytes(storages), before, strict=True))

    expected = pool_before.clone()
    pairs, offsets = engine.last_job_table
    for group in range(engine.num_groups):
        for block, row, slot in pairs[offsets[group] : offsets[group + 1]].tolist():
            for index in engine.layout.group_planes[group]:
                plane = engine.layout.planes[index]
                start = plane.pool_offset + slot * plane.page_bytes
                expected[row, start : start + plane.page_bytes] = plane.view[block].cpu()
    assert torch.equal(engine.pool, expected)

    for group, blocks in enumerate(gpu):  # poison the stored blocks
        for index in engine.layout.group_planes[group]:
            engine.layout.planes[index].view[blocks] = 0xAB
    assert engine.submit_load(
        "l", gpu_blocks=LOAD_TARGETS, host_blocks=host, first_block_index=first
    )
    engine.wait(["l"])
    assert drain(engine, 1)[0].success
    for group, (blocks, targets) in enumerate(zip(gpu, LOAD_TARGETS, strict=True)):
        for index in engine.layout.group_planes[group]:
            view = engine.layout.planes[index].view.cpu()
            for block, target in zip(blocks, targets, strict=True):
                plane = engine.layout.planes[index]
                # The page as it was before the store: from the byte snapshot.
                storage = next(
                    (s, b)
                    for s, b in zip(storages, before, strict=True)
                    if s.data_ptr() <= plane.base_address < s.data_ptr() + b.numel()
                )
                offset = plane.base_address - storage[0].data_ptr() + block * plane.block_stride
                assert torch.equal(view[target], storage[1][offset : offset + plane.page_bytes])
    engine.shutdown()


def test_triton_and_dma_give_identical_pool_bytes() -> None:
    pools = []
    for backend in ("triton", "dma"):
        caches, _ = hybrid_caches(seed=4)
        engine = TransferEngine(plan(3), caches, HOST_BLOCKS, backend=backend)
        engine.submit_store(
            0,
            gpu_blocks=[[5, 6, 7, 8], [1], [2, 3]],
            host_blocks=[[0, 1], [2], [3]],
            first_block_index=[2, 0, 1],
        )
        engine.submit_store(
            1,
            gpu_blocks=[[0, 1, 2], [3, 4], []],
            host_blocks=[[4], [5, 6], []],
            first_block_index=[0, 2, 0],
        )
        assert all(r.success for r in drain(engine, 2))
        pools.append(engine.pool.clone())
        engine.shutdown()
    assert torch.equal(pools[0], pools[1])


@pytest.mark.parametrize("backend", ["triton", "dma"])
def test_store_waits_for_the_compute_stream(backend: str) -> None:
    """RAW: a store submitted after a (slow) writer kernel must copy what it wrote."""
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend=backend)
    kv = caches[0][0][0]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on the compute stream before the write
    kv[4].fill_(7.0)
    engine.submit_store(0, gpu_blocks=[[4], [], []], host_blocks=[[9], [], []])
    engine.wait([0])
    assert drain(engine, 1)[0].success
    expected = torch.full_like(kv[4], 7.0).view(torch.uint8).flatten().cpu()
    assert torch.equal(engine.pool_view(0)[9, 0], expected)


@pytest.mark.parametrize("backend", ["triton", "dma"])
def test_load_waits_for_the_compute_stream(backend: str) -> None:
    """WAR: a load must not overwrite a block that a queued reader has not read yet."""
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend=backend)
    kv = caches[0][0][0]
    kv[5].fill_(1.0)
    engine.pool.fill_(0)  # the load writes zeros into block 5
    torch.cuda.synchronize()
    read = torch.empty_like(kv[5])
    torch.cuda._sleep(200_000_000)
    read.copy_(kv[5])  # the reader, queued behind the sleep
    engine.submit_load(0, gpu_blocks=[[5], [], []], host_blocks=[[3], [], []])
    engine.wait([0])
    torch.cuda.synchronize()
    assert drain(engine, 1)[0].success
    assert torch.equal(read, torch.ones_like(read))
    assert torch.equal(kv[5], torch.zeros_like(kv[5]))


def test_fifo_per_direction_and_staging_reuse() -> None:
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="triton")
    jobs = 3 * 64 + 5  # more jobs than staging buffers
    for job in range(jobs):
        engine.submit_store(
            ("s", job),
            gpu_blocks=[[job % NUM_BLOCKS], [], []],
            host_blocks=[[job % HOST_BLOCKS], [], []],
        )
    engine.submit_load(("l", 0), gpu_blocks=[[15], [], []], host_blocks=[[0], [], []])
    results = drain(engine, jobs + 1)
    stores = [r.job_id for r in results if r.job_id[0] == "s"]
    assert stores == [("s", job) for job in range(jobs)]
    assert all(r.success for r in results)
    last = max(j for j in range(jobs) if j % HOST_BLOCKS == 0)
    assert torch.equal(engine.pool_view(0)[0, 0], engine.layout.planes[0].view[last % 16].cpu())


def test_dma_merges_contiguous_runs() -> None:
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(4), caches, HOST_BLOCKS, backend="dma")
    engine.submit_store(0, gpu_blocks=[[4, 5, 6, 7], [], []], host_blocks=[[2], [], []])
    engine.wait([0])
    # K and V planes: one copy per plane for the 4 adjacent blocks in 4 adjacent slots.
    assert engine.copiers["dma"].last_copy_count == 2
    engine.submit_store(1, gpu_blocks=[[], [4, 5, 6, 7], []], host_blocks=[[], [3], []])
    engine.wait([1])
    assert engine.copiers["dma"].last_copy_count == 4  # padded plane: one copy per page
    assert all(r.success for r in drain(engine, 2))


def test_pool_pinned_in_pieces_with_one_device_mapping() -> None:
    from triton_offload.transfer.pool import piece_ranges

    caches, _ = hybrid_caches()
    # Pieces hold whole rows and whole OS pages, so a piece is at least page / gcd(page,
    # row) rows (up to 256 for 16-byte rows): 513 rows give at least three pieces.
    rows = 513
    engine = TransferEngine(plan(1), caches, rows, backend="triton", pool_piece_bytes=64 << 10)
    assert engine._pool.locked_by == "cudaHostRegister", (
        "cudaHostRegister was refused here: the pool fell back to torch's pinned "
        "allocator (the warning in the log names the CUDA error)"
    )
    expected = piece_ranges(rows, engine.row_bytes, 64 << 10)
    assert len(expected) >= 3
    assert len(engine._pool._pieces) == len(expected)
    assert_page_locked(engine)
    engine.submit_store(0, gpu_blocks=[[1], [2], [3]], host_blocks=[[0], [rows - 1], [5]])
    engine.wait([0])
    assert drain(engine, 1)[0].success
    assert torch.equal(engine.pool_view(2)[rows - 1, 0], engine.layout.planes[2].view[2].cpu())
    engine.shutdown()


def _row_sized_caches(seed: int) -> tuple[list, list[torch.Tensor]]:
    """Rows of 1.5 OS pages (6,144 bytes): K/V of 3,072 bytes, Mamba conv 1,000 + SSM
    5,000 bytes (odd sizes; the SSM slot crosses a page boundary inside the row)."""
    device = torch.device("cuda")
    kv = torch.empty(2, NUM_BLOCKS, 3072, dtype=torch.uint8, device=device)
    conv = torch.empty(NUM_BLOCKS, 1000, dtype=torch.uint8, device=device)
    ssm = torch.empty(NUM_BLOCKS, 5000, dtype=torch.uint8, device=device)
    storages = [kv, conv, ssm]
    for index, tensor in enumerate(storages):
        random_fill(tensor, seed + index)
    return [[(kv[0], kv[1])], [], [(conv, ssm)]], storages


@pytest.mark.parametrize("backend", ["dma", "auto", "triton"])
def test_jobs_across_pool_pieces_are_byte_exact(backend: str) -> None:
    """One job's pages spread over every page-locked piece of the engine's own pool (the
    smallest pieces: two rows each), stored and loaded back byte for byte."""
    caches, storages = _row_sized_caches(seed=21)
    # auto: 1,000-byte conv pages by the kernel, the rest by DMA, in one job.
    options = {"crossover": 2048} if backend == "auto" else {}
    engine = TransferEngine(
        plan(1), caches, HOST_BLOCKS, backend=backend, pool_piece_bytes=1, **options
    )
    try:
        pool = engine._pool
        assert pool.locked_by == "cudaHostRegister", "cudaHostRegister was refused here"
        assert engine.row_bytes == 6144 and len(pool._pieces) == HOST_BLOCKS // 2
        base = engine.pool.data_ptr()
        assert all((piece - base) % engine.row_stride == 0 for piece in pool._pieces)
        engine.pool.fill_(0xA5)
        pool_before = engine.pool.clone()
        before = host_bytes(storages)
        rows = torch.randperm(HOST_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
        gpu = [[5, 0, 9, 14, 3, 7], [], [2, 11, 8, 4, 13, 1]]
        host = [rows[:6], [], rows[6:]]
        assert engine.submit_store("s", gpu_blocks=gpu, host_blocks=host)
        assert drain(engine, 1)[0].success
        if backend == "auto":
            assert engine.last_job_backend == "dma+triton"
        assert all(torch.equal(a, b) for a, b in zip(host_bytes(storages), before, strict=True))
        expected = pool_before.clone()
        for group in (0, 2):
            for index in engine.layout.group_planes[group]:
                plane = engine.layout.planes[index]
                for block, row in zip(gpu[group], host[group], strict=True):
                    start = plane.pool_offset
                    expected[row, start : start + plane.page_bytes] = plane.view[block].cpu()
        assert torch.equal(engine.pool, expected)
        for group in (0, 2):  # poison the stored blocks, then load them back
            for index in engine.layout.group_planes[group]:
                engine.layout.planes[index].view[gpu[group]] = 0xCD
        assert engine.submit_load("l", gpu_blocks=gpu, host_blocks=host)
        assert drain(engine, 1)[0].success
        assert torch.equal(engine.pool, expected)
        assert all(torch.equal(a, b) for a, b in zip(host_bytes(storages), before, strict=True))
    finally:
        engine.shutdown()


def test_pageable_pool_and_cpu_backend_rejected() -> None:
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="dma")
    pageable = torch.zeros(HOST_BLOCKS, engine.row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pool is pageable host memory"):
        TransferEngine(plan(1), caches, HOST_BLOCKS, backend="dma", pool=pageable)
    with pytest.raises(ValueError, match="backend 'torch' is the CPU path"):
        TransferEngine(plan(1), caches, HOST_BLOCKS, backend="torch")


def test_calibrated_crossover_and_configured_threshold() -> None:
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="auto")
    grid = engine.crossover.grid
    assert set(grid) == {0, 1}
    for points in grid.values():
        assert points and set(points.values()) <= {"dma", "triton"}
    engine.submit_store(0, gpu_blocks=[[1], [2], [3]], host_blocks=[[0], [1], [2]])
    assert engine.last_job_backend in ("dma", "triton", "dma+triton")
    assert drain(engine, 1)[0].success

    always_dma = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="auto", crossover=0)
    always_dma.submit_store(0, gpu_blocks=[[1], [], []], host_blocks=[[0], [], []])
    assert always_dma.last_job_backend == "dma"
    never = TransferEngine(
        plan(1), caches, HOST_BLOCKS, backend="auto", crossover={"store": 1 << 40, "load": 0}
    )
    never.submit_store(0, gpu_blocks=[[1], [], []], host_blocks=[[0], [], []])
    assert never.last_job_backend == "triton"
    never.submit_load(1, gpu_blocks=[[2], [], []], host_blocks=[[0], [], []])
    assert never.last_job_backend == "dma"
    assert all(r.success for r in drain(always_dma, 1) + drain(never, 2))


def _compiled_variants() -> int:
    """Compiled variants of the copy kernel on the current device (Triton's JIT cache)."""
    from triton_offload.kernels import copy_blocks

    caches = copy_blocks._copy_blocks_kernel.device_caches
    return sum(len(entry[0]) for entry in caches.values())


def test_dma_backend_makes_one_batched_call_per_job() -> None:
    caches, storages = hybrid_caches(seed=7)
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="dma")
    copier = engine.copiers["dma"]
    if copier.batch is None:
        pytest.skip(f"this driver has no cuMemcpyBatchAsync: {copier.mode}")
    assert copier.mode.startswith("batched (cuMemcpyBatchAsync")
    before = host_bytes(storages)
    gpu, host = [[3, 9, 4], [0, 15], [7]], [[2, 5, 6], [11, 10], [8]]
    assert engine.submit_store("s", gpu_blocks=gpu, host_blocks=host)
    engine.wait(["s"])
    assert copier.batch.calls == 1 and copier.last_call_count == 1
    assert copier.last_copy_count > 1  # many descriptors, one call
    for group, blocks in enumerate(gpu):  # poison, then load back
        for index in engine.layout.group_planes[group]:
            engine.layout.planes[index].view[blocks] = 0xCD
    assert engine.submit_load("l", gpu_blocks=gpu, host_blocks=host)
    engine.wait(["l"])
    assert copier.batch.calls == 2
    assert all(r.success and r.transfer_time > 0 for r in drain(engine, 2))
    assert all(torch.equal(a, b) for a, b in zip(host_bytes(storages), before, strict=True))
    engine.shutdown()


@pytest.mark.parametrize("threshold", [1024, 16 << 10])
def test_mixed_job_kernel_and_dma_on_one_stream(threshold: int) -> None:
    """DMA for pages >= threshold, the kernel for the rest, in one job with one event
    pair; the pool and the loaded caches equal a kernel-only engine's bytes."""
    results = []
    for backend, kwargs in (("triton", {}), ("auto", {"crossover": threshold})):
        caches, storages = hybrid_caches(seed=9)
        engine = TransferEngine(plan(2), caches, HOST_BLOCKS, backend=backend, **kwargs)
        engine.pool.fill_(0xA5)
        gpu, host, first = STORE
        assert engine.submit_store("s", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        if backend == "auto":
            assert engine.last_job_backend == "dma+triton"
            names = [name for name, _ in engine.last_job_assignment]
            assert names == ["dma", "triton"]
        for group, blocks in enumerate(gpu):
            for index in engine.layout.group_planes[group]:
                engine.layout.planes[index].view[blocks] = 0xCD
        assert engine.submit_load("l", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        engine.wait(["s", "l"])
        done = drain(engine, 2)
        assert all(r.success and r.transfer_time > 0 for r in done)
        results.append([engine.pool.clone(), *host_bytes(storages)])
        engine.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_calibration_runs_through_the_engine_and_leaves_the_caches() -> None:
    caches, storages = hybrid_caches(seed=11)
    before = host_bytes(storages)
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="auto")
    assert all(torch.equal(a, b) for a, b in zip(host_bytes(storages), before, strict=True))
    crossover = engine.crossover
    assert crossover is not None and set(crossover.grid) == {0, 1}
    for direction, points in crossover.timings.items():
        assert points and all(set(t) == {"dma", "triton"} for t in points.values())
        assert all(v > 0 for t in points.values() for v in t.values()), direction
    assert len(crossover.describe()) == sum(len(p) for p in crossover.grid.values())
    for direction, points in crossover.grid.items():
        assert set(crossover.host_timings[direction]) == set(points)
        assert all(crossover.planes[point] >= 1 for point in points)
    # Labelled by the blocks moved: 16 and 256 wanted, both capped at the 12 pool rows.
    assert {blocks for _, blocks in crossover.grid[0]} == {min(NUM_BLOCKS, HOST_BLOCKS)}
    assert engine.get_finished() == []  # calibration jobs are not reported
    engine.shutdown()


def test_engine_warms_the_kernel_and_odd_jobs_do_not_recompile() -> None:
    caches, _ = hybrid_caches()
    engine = TransferEngine(plan(1), caches, HOST_BLOCKS, backend="triton")
    compiled = _compiled_variants()
    assert compiled >= 1  # compiled at construction
    for job, count in enumerate((1, 2, 3, 5, 8)):
        engine.submit_store(
            job, gpu_blocks=[list(range(count)), [], []], host_blocks=[list(range(count)), [], []]
        )
    engine.wait(range(5))
    assert all(r.success for r in drain(engine, 5))
    assert _compiled_variants() == compiled  # odd and even pair counts: one variant
    engine.shutdown()


@pytest.mark.parametrize("backend", ["triton", "dma", "auto"])
def test_page_checksums_are_computed_on_the_device(backend: str) -> None:
    """On every CUDA path a checksummed job's page sums equal ``page_checksum`` of each
    row's payload (wsum64), for a store with partial first chunks and for the load of
    the same rows (the slots a job does not move are summed from the pool side), and
    the copy stays byte-exact."""
    from triton_offload.transfer.seal import page_checksum

    caches, _ = hybrid_caches()
    kwargs = {"crossover": 32 << 10} if backend == "auto" else {}
    engine = TransferEngine(
        plan(), caches, HOST_BLOCKS, backend=backend, page_checksums=True, **kwargs
    )
    assert engine.checksum_algorithm == "wsum64"
    # Random bytes everywhere: the slots a job does not move and the bytes between
    # the planes' slots (stale bytes of a row another group used) are summed too.
    engine.pool.copy_(torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8))
    gpu, host, first = STORE

    def expected_sums(rows: Any) -> list[int]:
        pool = engine.pool.numpy()
        sums = []
        for row in rows.tolist():
            group = next(g for g, chunks in enumerate(host) if row in chunks)
            sums.append(page_checksum(pool[row, : engine.layout.group_row_bytes[group]], "wsum64"))
        return sums

    assert engine.submit_store(
        "s", gpu_blocks=gpu, host_blocks=host, first_block_index=first, checksum=True
    )
    engine.wait(["s"])
    (stored,) = drain(engine, 1)
    assert stored.success and stored.checksums is not None
    assert stored.checksums.algorithm == "wsum64"
    assert sorted(stored.checksums.rows.tolist()) == sorted(r for rows in host for r in rows)
    assert stored.checksums.values.tolist() == expected_sums(stored.checksums.rows)
    pool_after_store = engine.pool.clone()
    assert engine.submit_load(
        "l", gpu_blocks=LOAD_TARGETS, host_blocks=host, first_block_index=first, checksum=True
    )
    engine.wait(["l"])
    (loaded,) = drain(engine, 1)
    assert loaded.success and loaded.checksums is not None
    assert loaded.checksums.values.tolist() == stored.checksums.values.tolist()
    assert torch.equal(engine.pool, pool_after_store)  # a load's passes write no pool byte
    engine.shutdown()
