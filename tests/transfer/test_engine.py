"""TransferEngine round trips on the CPU: the torch path and the Triton kernel (interpreter).

The hybrid model: a full-attention group with K/V planes (views of one ``(2, blocks,
...)`` tensor), a sliding-window group whose blocks have a padded stride, and a Mamba
group with a conv and an SSM state plane of different (odd) sizes; DCP=2. Every check
is byte-exact: source unchanged, addressed destination equal, the rest untouched.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.hybrid_engine import (
    BACKENDS,
    INTERPRETED,
    NUM_BLOCKS,
    NUM_HOST_BLOCKS,
    _HostCopies,
    expected_store,
    hybrid_caches,
    hybrid_plan,
    make_engine,
    raw_bytes,
    same_bytes,
    snapshot,
    store_job,
)
from triton_offload.transfer.engine import TransferEngine, TransferResult


def job_bytes(caches: list, gpu_blocks: list) -> int:
    """Bytes a job moves, from the tensors' shapes: pages of every plane of every block."""
    per_block = []
    for layers in caches:
        total = 0
        for layer in layers:
            for tensor in layer if isinstance(layer, tuple) else (layer,):
                total += tensor[0].numel() * tensor.element_size()
        per_block.append(total)
    return sum(len(blocks) * size for blocks, size in zip(gpu_blocks, per_block, strict=True))


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip(backend: str, blocks_per_chunk: int) -> None:
    caches, storages = hybrid_caches()
    engine = make_engine(caches, blocks_per_chunk, backend)
    generator = torch.Generator().manual_seed(1)
    engine.pool.copy_(
        torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8, generator=generator)
    )  # poison the pool
    pool_before = engine.pool.clone()
    caches_before = snapshot(storages)

    gpu, host, first = store_job(blocks_per_chunk)
    assert (
        engine.submit_store("store", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        is True
    )
    (result,) = engine.get_finished()
    assert result.job_id == "store" and result.success
    assert result.transfer_size == job_bytes(caches, gpu)
    assert result.transfer_time >= 0.0
    assert engine.get_finished() == []  # reported once

    pairs, offsets = engine.last_job_table
    assert same_bytes(storages, caches_before)
    assert torch.equal(engine.pool, expected_store(engine, pool_before, pairs, offsets))

    # Poison the stored GPU blocks, then load into other GPU blocks.
    for group, blocks in enumerate(gpu):
        for index in engine.layout.group_planes[group]:
            view = engine.layout.planes[index].view
            for block in blocks:
                view[block] = torch.randint(
                    0, 256, view[block].shape, dtype=torch.uint8, generator=generator
                )
    targets = [[1, 3, 8, 10], [0, 6], [2, 11, 7]][: len(gpu)]
    targets = [t[: len(g)] for t, g in zip(targets, gpu, strict=True)]
    pool_after_store = engine.pool.clone()
    before_load = snapshot(storages)
    assert (
        engine.submit_load("load", gpu_blocks=targets, host_blocks=host, first_block_index=first)
        is True
    )
    (result,) = engine.get_finished()
    assert result == TransferResult("load", True, job_bytes(caches, targets), result.transfer_time)
    assert torch.equal(engine.pool, pool_after_store)  # the source is unchanged

    touched: dict[int, set[int]] = {}
    for group, (blocks, dest) in enumerate(zip(gpu, targets, strict=True)):
        for index in engine.layout.group_planes[group]:
            plane = engine.layout.planes[index]
            touched.setdefault(index, set()).update(dest)
            for source, target in zip(blocks, dest, strict=True):
                original = caches_before_view(caches_before, storages, plane, source)
                assert torch.equal(plane.view[target], original), (plane.name, source, target)
    # Everything else in the caches is unchanged (padding bytes included).
    for index, plane in enumerate(engine.layout.planes):
        for block in range(NUM_BLOCKS):
            if block in touched.get(index, set()):
                continue
            old = caches_before_view(before_load, storages, plane, block)
            assert torch.equal(plane.view[block], old), (plane.name, block)
    for storage, old in zip(storages, before_load, strict=True):
        if storage.dim() == 2 and storage.dtype == torch.float16 and storage.shape[1] == 40:
            rows = raw_bytes(storage).view(NUM_BLOCKS, 80)
            old_rows = old.view(NUM_BLOCKS, 80)
            assert torch.equal(rows[:, :8], old_rows[:, :8])  # padding of the window plane
            assert torch.equal(rows[:, 72:], old_rows[:, 72:])


def caches_before_view(
    copies: list[torch.Tensor],
    storages: list[torch.Tensor],
    plane,
    block: int,
) -> torch.Tensor:
    """Page ``block`` of ``plane`` as it was in the snapshot ``copies`` of ``storages``."""
    for storage, copy in zip(storages, copies, strict=True):
        start = storage.data_ptr()
        end = start + storage.numel() * storage.element_size()
        if start <= plane.base_address < end:
            offset = plane.base_address - start + block * plane.block_stride
            return copy[offset : offset + plane.page_bytes]
    raise AssertionError(f"no storage holds {plane.name}")


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_backends_give_identical_pool_bytes(blocks_per_chunk: int) -> None:
    if not INTERPRETED:
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for the kernel")
    pools = {}
    loaded = {}
    for backend in ("torch", "triton"):
        caches, storages = hybrid_caches(seed=5)
        engine = make_engine(caches, blocks_per_chunk, backend)
        gpu, host, first = store_job(blocks_per_chunk)
        engine.submit_store(1, gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        # Consecutive blocks and slots: merged runs on the CPU path.
        if blocks_per_chunk == 3:
            engine.submit_store(2, gpu_blocks=[[0, 1, 2], [], [8, 9]], host_blocks=[[5], [], [6]])
            engine.submit_load(
                3,
                gpu_blocks=[[4, 5, 6], [1], [0, 1]],
                host_blocks=[[5], [8], [2]],
                first_block_index=[0, 4, 0],
            )
        else:
            engine.submit_store(
                2, gpu_blocks=[[0, 1, 2], [], [8, 9]], host_blocks=[[5, 4, 7], [], [6, 1]]
            )
            engine.submit_load(
                3, gpu_blocks=[[4, 5, 6], [1], [0, 1]], host_blocks=[[5, 4, 7], [8], [6, 1]]
            )
        results = engine.get_finished()
        assert [r.job_id for r in results] == [1, 2, 3]
        assert all(r.success for r in results)
        pools[backend] = engine.pool.clone()
        loaded[backend] = snapshot(storages)
    assert torch.equal(pools["torch"], pools["triton"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["torch"], loaded["triton"], strict=True))


def test_job_table_is_one_row_per_block_pair_whatever_the_layers() -> None:
    sizes = {}
    for layers in (2, 64):
        caches, _ = hybrid_caches(layers=layers)
        engine = make_engine(caches, 3, "torch")
        gpu, host, first = store_job(3)
        engine.submit_store(0, gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        assert engine.get_finished()[0].success
        pairs, offsets = engine.last_job_table
        sizes[layers] = (pairs.shape, offsets.shape, engine.last_job_table_size)
        assert len(engine.layout.planes) == 5 * layers
    pairs_count = sum(len(g) for g in store_job(3)[0])
    assert sizes[2] == sizes[64] == ((pairs_count, 3), (4,), pairs_count)


def test_job_table_slots_follow_first_block_index() -> None:
    caches, _ = hybrid_caches()
    engine = make_engine(caches, 3, "torch")
    engine.submit_store(
        0,
        gpu_blocks=[[7, 2, 9, 0], [4], []],
        host_blocks=[[3, 0], [8], []],
        first_block_index=[5, 7, 0],
    )
    pairs, offsets = engine.last_job_table
    # Group 0: positions 2, 3, 4, 5 -> (host 3, slot 2), (host 0, slots 0..2).
    assert pairs.tolist() == [[7, 3, 2], [2, 0, 0], [9, 0, 1], [0, 0, 2], [4, 8, 1]]
    assert offsets.tolist() == [0, 4, 5, 5]


def test_fifo_completion_and_wait() -> None:
    caches, _ = hybrid_caches()
    engine = make_engine(caches, 1, "torch")
    for job in range(4):
        engine.submit_store(job, gpu_blocks=[[job], [job], []], host_blocks=[[job], [job + 4], []])
    engine.wait([2, 0])
    assert [r.job_id for r in engine.get_finished()] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="job id 2 is unknown"):
        engine.wait([2])
    engine.submit_store(
        2, gpu_blocks=[[0], [], []], host_blocks=[[1], [], []]
    )  # a reported id may be reused
    assert [r.job_id for r in engine.get_finished()] == [2]
    engine.shutdown()
    assert engine.submit_store(9, gpu_blocks=[[0], [], []], host_blocks=[[1], [], []]) is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_failing_job_is_reported_and_the_next_works(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, _ = hybrid_caches()
    engine = make_engine(caches, 1, backend)
    calls = {"n": 0}
    if backend == "torch":
        from triton_offload.transfer import cpu_copy

        target, name = cpu_copy, "copy_pages"
    else:
        target, name = engine.copiers["triton"].kernels, "launch_copy"
    original = getattr(target, name)

    def fail_once(*args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected copy failure")
        original(*args, **kwargs)

    monkeypatch.setattr(target, name, fail_once)
    engine.submit_store("bad", gpu_blocks=[[1], [], []], host_blocks=[[0], [], []])
    engine.submit_store("good", gpu_blocks=[[2], [3], []], host_blocks=[[1], [2], []])
    bad, good = engine.get_finished()
    assert (bad.job_id, bad.success) == ("bad", False)
    assert (good.job_id, good.success) == ("good", True)
    plane = engine.layout.planes[0]
    assert torch.equal(engine.pool_view(0)[1, 0], plane.view[2])
    assert calls["n"] == 2


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_dma_copies_address_the_same_bytes_as_the_cpu_path(blocks_per_chunk: int) -> None:
    """The DMA path's address arithmetic (run merging included), checked on host memory."""
    from types import SimpleNamespace

    from triton_offload.transfer.copiers import DmaCopier, JobHolds
    from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec

    gpu, host, first = store_job(blocks_per_chunk)
    runs_gpu, runs_host = ([[0, 1, 2], [], [8, 9]], [[5], [], [6]])
    if blocks_per_chunk == 1:
        runs_host = [[5, 4, 7], [], [6, 1]]
    targets = [[1, 3, 8, 10], [0, 6], [2, 11, 7]]
    jobs = [
        (TO_POOL, gpu, host, first),
        (TO_POOL, runs_gpu, runs_host, None),
        (FROM_POOL, [t[: len(g)] for t, g in zip(targets, gpu, strict=True)], host, first),
    ]
    states = []
    copies = 0
    for path in ("torch", "dma"):
        caches, storages = hybrid_caches(seed=11)
        engine = make_engine(caches, blocks_per_chunk, "torch")
        api = _HostCopies()
        copier = DmaCopier(engine.layout, engine.pool_address, engine.row_stride, api)
        stream = SimpleNamespace(cuda_stream=1234)
        for job, (direction, gpu_blocks, host_blocks, first_index) in enumerate(jobs):
            if path == "torch":
                if direction == TO_POOL:
                    engine.submit_store(
                        job,
                        gpu_blocks=gpu_blocks,
                        host_blocks=host_blocks,
                        first_block_index=first_index,
                    )
                else:
                    engine.submit_load(
                        job,
                        gpu_blocks=gpu_blocks,
                        host_blocks=host_blocks,
                        first_block_index=first_index,
                    )
                assert engine.get_finished()[0].success
            else:
                table = engine.build_job_table(
                    JobSpec(gpu_blocks, host_blocks, first_index), direction
                )
                copier.prepare(table, direction, None, JobHolds(), stream)()
                copies += copier.last_copy_count
        states.append([engine.pool.clone(), *snapshot(storages)])
        if path == "dma":
            assert {call[3] for call in api.calls} == {1234}
            pages = sum(
                len(g) * len(engine.layout.group_planes[i])
                for job in jobs
                for i, g in enumerate(job[1])
            )
            if blocks_per_chunk == 3:
                assert copies < pages  # the adjacent K/V pages of job 1 were merged
            assert len(api.calls) == copies
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.cuda_stream = name, log, id(self)

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait", self.name, event))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class _FakeEvent:
    """A CUDA event stand-in: complete once ``done`` is set."""

    log: ClassVar[list] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.done = False
        self.stream: _FakeStream | None = None

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 2.0  # milliseconds


def test_cuda_job_flow_with_stand_in_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA submit path without a GPU: event order, FIFO polling, staging reuse.

    Streams and events are stand-ins, the launcher is a stand-in module that copies
    with the CPU path on host memory; what is checked is the order of operations, the
    staging of the tables and FIFO completion.
    """
    import contextlib
    from types import SimpleNamespace

    from triton_offload.transfer import copiers, cpu_copy
    from triton_offload.transfer.selection import FixedPath

    caches, _ = hybrid_caches()
    engine = make_engine(caches, 1, "torch")
    log: ClassVar[list] = []
    _FakeEvent.log = log
    compute = _FakeStream("compute", log)
    launches: list = []

    def launch(tables: Any, pairs: torch.Tensor, offsets: torch.Tensor, *args: Any, **kw: Any):
        log.append(("launch", engine.last_job_table))
        launches.append((pairs.clone(), offsets.clone()))
        # One packed table: the offsets follow the pairs with no padding word (no kernel
        # argument is specialized on its alignment).
        assert offsets.data_ptr() == pairs.data_ptr() + pairs.numel() * 8
        cpu_copy.copy_pages(
            engine.layout,
            engine.pool_address,
            engine.row_stride,
            pairs.numpy(),
            offsets.numpy(),
            args[1],
        )

    kernels = SimpleNamespace(
        TILE_BYTES=8192, launch_copy=launch, default_num_programs=lambda device, tile: 4
    )
    monkeypatch.setattr(
        copiers, "_pinned_int64", lambda n: torch.empty(max(n, 1024), dtype=torch.int64)
    )
    triton = copiers.TritonCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        device=engine.device,
        cuda=True,
        kernels=kernels,  # type: ignore[arg-type]
    )
    engine.cuda = True
    engine._streams = {0: _FakeStream("store", log), 1: _FakeStream("load", log)}
    engine.copiers = {"triton": triton}
    engine.policy = FixedPath("triton")
    prepare = triton.prepare

    def logged_prepare(*args: Any, **kwargs: Any) -> Any:
        run = prepare(*args, **kwargs)  # staging fill and table upload happen here
        log.append(("prepared", "store"))
        return run

    monkeypatch.setattr(triton, "prepare", logged_prepare)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)

    gpu, host, first = store_job(1)
    assert engine.submit_store("a", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
    # compute-stream event, host preparation (the table upload is enqueued before the
    # wait, overlapping compute), store stream waits on it, then start, launch, end.
    # The start event follows the host preparation: transfer_time is the copy alone.
    kinds = [entry[0] if entry[0] == "launch" else (entry[0], entry[1]) for entry in log]
    assert kinds == [
        ("record", "compute"),
        ("prepared", "store"),
        ("wait", "store"),
        ("record", "store"),
        "launch",
        ("record", "store"),
    ]
    assert log[2][2] is log[0][2]
    pairs, offsets = launches[0]
    assert torch.equal(pairs, torch.from_numpy(engine.last_job_table[0]))
    assert torch.equal(offsets, torch.from_numpy(engine.last_job_table[1]))
    end_a = log[-1][2]

    engine.submit_store("b", gpu_blocks=[[0], [], []], host_blocks=[[4], [], []])
    end_b = log[-1][2]
    engine.submit_load("c", gpu_blocks=[[1], [], []], host_blocks=[[4], [], []])
    end_c = log[-1][2]
    # Job a's staging buffer is still in use: b got a second buffer.
    assert len(triton.staging.buffers) == 3
    assert engine.get_finished() == []
    end_b.done = True  # b finished before a: FIFO holds it back
    assert engine.get_finished() == []
    end_c.done = True  # another direction: reported on its own
    assert [r.job_id for r in engine.get_finished()] == ["c"]
    end_a.done = True
    results = engine.get_finished()
    assert [(r.job_id, r.success, r.transfer_time) for r in results] == [
        ("a", True, 0.002),
        ("b", True, 0.002),
    ]
    assert results[0].transfer_size == job_bytes(caches, gpu)
    # All buffers are free again: the next job reuses one.
    engine.submit_store("d", gpu_blocks=[[0], [], []], host_blocks=[[4], [], []])
    assert len(triton.staging.buffers) == 3
    engine.wait(["d"])
    assert [r.job_id for r in engine.get_finished()] == ["d"]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), blocks_per_chunk=st.integers(1, 4))
def test_random_jobs_match_the_reference(data: st.DataObject, blocks_per_chunk: int) -> None:
    """Random stores then loads on the torch path, against the plain torch reference."""
    from triton_offload.transfer.jobs import Direction
    from triton_offload.transfer.reference import reference_copy

    caches, storages = hybrid_caches(seed=data.draw(st.integers(0, 3)))
    engine = make_engine(caches, blocks_per_chunk, "torch")
    engine.pool.copy_(torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8))
    rows = data.draw(st.permutations(range(NUM_HOST_BLOCKS)))
    gpu, host, first = [], [], []
    for _ in range(engine.num_groups):
        start = data.draw(st.integers(0, 7))
        count = data.draw(st.integers(0, 5))
        chunks = -(-(start % blocks_per_chunk + count) // blocks_per_chunk) if count else 0
        if chunks > len(rows):
            count, chunks = 0, 0
        if data.draw(st.booleans()):  # adjacent blocks: merged runs on the CPU path
            low = data.draw(st.integers(0, NUM_BLOCKS - count))
            gpu.append(list(range(low, low + count)))
        else:
            gpu.append(data.draw(st.permutations(range(NUM_BLOCKS)))[:count])
        host.append([rows.pop() for _ in range(chunks)])
        first.append(start)
    expected_pairs = [
        [
            block,
            host[g][(first[g] % blocks_per_chunk + k) // blocks_per_chunk],
            (first[g] % blocks_per_chunk + k) % blocks_per_chunk,
        ]
        for g in range(engine.num_groups)
        for k, block in enumerate(gpu[g])
    ]
    views = [plane.view for plane in engine.layout.planes]
    for direction in (Direction.TO_POOL, Direction.FROM_POOL):
        pool = engine.pool.clone()
        before = snapshot(storages)
        if direction == Direction.TO_POOL:
            engine.submit_store(0, gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        else:
            engine.submit_load(0, gpu_blocks=gpu, host_blocks=host, first_block_index=first)
        assert engine.get_finished()[0].success
        pairs, offsets = engine.last_job_table
        assert pairs.tolist() == expected_pairs
        got = [engine.pool.clone(), *snapshot(storages)]
        # Replay on the snapshots with the reference.
        engine.pool.copy_(pool)
        for storage, old in zip(storages, before, strict=True):
            raw_bytes(storage).copy_(old)
        reference_copy(
            views,
            engine.layout,
            torch.from_numpy(pairs),
            torch.from_numpy(offsets),
            engine.pool,
            direction,
        )
        want = [engine.pool.clone(), *snapshot(storages)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for group in range(engine.num_groups):  # poison before the load
            for index in engine.layout.group_planes[group]:
                engine.layout.planes[index].view[gpu[group]] = 0x5A


@settings(max_examples=60, deadline=None)
@given(data=st.data(), blocks_per_chunk=st.integers(1, 3))
def test_small_and_large_job_paths_build_and_reject_alike(
    data: st.DataObject, blocks_per_chunk: int
) -> None:
    """Small jobs are built with Python ints, large ones with numpy: same tables, same
    verdicts (ids drawn with repeats so that clashes and range errors occur)."""
    from triton_offload.transfer import jobs

    caches, _ = hybrid_caches()
    engine = make_engine(caches, blocks_per_chunk, "torch")
    ids = st.lists(st.integers(0, NUM_BLOCKS), max_size=5)
    rows = st.lists(st.integers(0, NUM_HOST_BLOCKS), max_size=3)
    spec = jobs.JobSpec(
        [data.draw(ids) for _ in range(3)],
        [data.draw(rows) for _ in range(3)],
        [data.draw(st.integers(0, 5)) for _ in range(3)],
    )
    direction = data.draw(st.sampled_from([jobs.TO_POOL, jobs.FROM_POOL]))
    outcomes = []
    for limit in (jobs.SMALL_JOB_PAIRS, 0):
        original, jobs.SMALL_JOB_PAIRS = jobs.SMALL_JOB_PAIRS, limit
        try:
            table = jobs.pair_table(engine.layout, NUM_HOST_BLOCKS, spec, direction)
            outcomes.append(("ok", table.pairs.tolist(), table.offsets.tolist()))
        except ValueError as error:
            outcomes.append(("error", str(error).split(" ")[:2], None))
        finally:
            jobs.SMALL_JOB_PAIRS = original
    assert outcomes[0] == outcomes[1]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), blocks_per_chunk=st.integers(1, 3))
def test_keyword_lists_build_and_reject_as_their_spec(
    data: st.DataObject, blocks_per_chunk: int
) -> None:
    """A small job given as lists of Python ints (a submit's keyword lists, no first
    index) gets the table and the error its ``JobSpec`` gets, on the Python and the numpy
    path (ids drawn with repeats so that clashes and range errors occur)."""
    from triton_offload.transfer import jobs

    caches, _ = hybrid_caches()
    engine = make_engine(caches, blocks_per_chunk, "torch")
    ids = st.lists(st.integers(0, NUM_BLOCKS), max_size=5)
    rows = st.lists(st.integers(0, NUM_HOST_BLOCKS), max_size=3)
    groups = data.draw(st.integers(2, 4))  # the engine has 3: other counts are refused
    gpu = [data.draw(ids) for _ in range(groups)]
    host = [data.draw(rows) for _ in range(groups)]
    direction = data.draw(st.sampled_from([jobs.TO_POOL, jobs.FROM_POOL]))
    plain = jobs.plain_job(gpu, host)
    assert plain is not None
    outcomes = []
    for build in ("plain", "python", "numpy"):
        original = jobs.SMALL_JOB_PAIRS
        if build == "numpy":
            jobs.SMALL_JOB_PAIRS = 0
        try:
            if build == "plain":
                table = jobs.plain_pair_table(engine.layout, NUM_HOST_BLOCKS, plain, direction)
            else:
                spec = jobs.JobSpec(gpu, host)
                table = jobs.pair_table(engine.layout, NUM_HOST_BLOCKS, spec, direction)
            outcomes.append(("ok", table.pairs.tolist(), table.offsets.tolist()))
        except ValueError as error:
            outcomes.append(("error", str(error), None))
        finally:
            jobs.SMALL_JOB_PAIRS = original
    assert outcomes[0] == outcomes[1]  # the same checks in the same order: the same words
    if outcomes[2][0] == "error":
        assert (
            outcomes[0][0] == "error"
            and outcomes[0][1].split(" ")[:2] == outcomes[2][1].split(" ")[:2]
        )
    else:
        assert outcomes[0] == outcomes[2]


def test_plain_job_takes_only_what_jobspec_takes_unchanged() -> None:
    """Lists that are not lists of non-negative int64 Python ints, or too many pairs for
    the Python table, are left to JobSpec (and its messages)."""
    from triton_offload.transfer import jobs

    assert jobs.plain_job([[1]], [[2]]) == ([[1]], [[2]])
    for gpu, host in [
        ([[1, True]], [[0]]),
        ([[1]], [[-1]]),
        ([[1]], [[2**63]]),
        ([[1.0]], [[0]]),
        ([(1,)], [[0]]),
        ([[1]], [[0], [1]]),
        (([1],), [[0]]),
        ([list(range(jobs.SMALL_JOB_PAIRS + 1))], [[0]]),
    ]:
        assert jobs.plain_job(gpu, host) is None, (gpu, host)
    caller = [[3, 4]]
    plain = jobs.plain_job(caller, [[0]])
    caller[0].append(5)  # the job keeps its own lists
    assert plain is not None and plain.gpu_blocks == [[3, 4]]


class _TimedEvent(_FakeEvent):
    """A stand-in event that remembers the host time of its record."""

    def record(self, stream: _FakeStream) -> None:
        super().record(stream)
        self.done = True
        self.at = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1e3


def test_calibration_runs_real_jobs_through_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate() without a GPU: the engine's own submit path, the interpreted kernel
    and a host-memmove stand-in for the DMA driver, on the engine's real layout.

    Checked: every grid point of both directions gets a winner and timings of both
    copiers, the DMA copies are whole pages (or merged runs) of the planes' sizes, the
    caches end byte-identical (each load writes back what its store read), and no
    calibration job is reported to the caller.
    """
    if not INTERPRETED:
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 for the kernel")
    from triton_offload.transfer import selection
    from triton_offload.transfer.copiers import DmaCopier

    caches, storages = hybrid_caches()
    engine = make_engine(caches, 1, "triton")
    api = _HostCopies()
    engine.copiers["dma"] = DmaCopier(engine.layout, engine.pool_address, engine.row_stride, api)
    monkeypatch.setattr(selection, "CALIBRATION_PAGES", (2, 5))
    monkeypatch.setattr(selection, "CALIBRATION_REPEATS", 1)
    before = snapshot(storages)
    crossover = selection.calibrate(engine)
    assert same_bytes(storages, before)
    assert engine.get_finished() == []
    page_sizes = sorted({p.page_bytes for p in engine.layout.planes})
    assert len(page_sizes) == 4  # 30, 64, 128 and 528 bytes
    for direction in (0, 1):
        points = crossover.grid[direction]
        assert set(points) == {(page, n) for page in page_sizes for n in (2, 5)}
        assert set(points.values()) <= {"dma", "triton"}
        assert all(set(t) == {"dma", "triton"} for t in crossover.timings[direction].values())
    assert all(any(call[2] % page == 0 for page in page_sizes) for call in api.calls)
    assert {call[2] for call in api.calls} >= set(page_sizes)
    assert crossover.choose(0, 40.0, 2) == crossover.grid[0][(30, 2)]
    assert crossover.choose(1, 10_000.0, 100) == crossover.grid[1][(528, 5)]
    assert len(crossover.describe()) == 2 * 4 * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_strided_pool_view_of_a_shared_region(backend: str) -> None:
    """Worker r's view into a shared region: chunk k at ``base + k * row_stride + r * page``.

    The engine takes the view as its pool; stores and loads land byte-exactly in the
    worker's rows, and every byte of the region outside them (the other worker's pages,
    the slack after each row) stays as poisoned.
    """
    caches, storages = hybrid_caches(seed=21)
    plan = hybrid_plan(3)
    row_bytes = TransferEngine(plan, caches, NUM_HOST_BLOCKS, backend="torch").row_bytes
    page = row_bytes + 16  # each worker's page, a little larger than one row holds
    row_stride = 2 * page + 8  # two workers' pages per chunk, then slack
    region = torch.randint(0, 256, (NUM_HOST_BLOCKS * row_stride,), dtype=torch.uint8)
    worker = 1
    view = region.as_strided((NUM_HOST_BLOCKS, row_bytes), (row_stride, 1), worker * page)
    engine = TransferEngine(plan, caches, NUM_HOST_BLOCKS, backend=backend, pool=view)
    assert engine.row_stride == row_stride and engine.pool.data_ptr() == view.data_ptr()
    mine = torch.zeros(region.numel(), dtype=torch.bool)
    for k in range(NUM_HOST_BLOCKS):
        start = k * row_stride + worker * page
        mine[start : start + row_bytes] = True
    region_before = region.clone()
    pool_before = view.clone()
    caches_before = snapshot(storages)

    gpu, host, first = store_job(3)
    assert engine.submit_store("s", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
    assert engine.get_finished()[0].success
    pairs, offsets = engine.last_job_table
    assert same_bytes(storages, caches_before)
    assert torch.equal(view, expected_store(engine, pool_before, pairs, offsets))
    assert torch.equal(region[~mine], region_before[~mine])

    for group, blocks in enumerate(gpu):  # poison the stored blocks, then load them back
        for index in engine.layout.group_planes[group]:
            engine.layout.planes[index].view[blocks] = 0x5A
    assert engine.submit_load("l", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
    assert engine.get_finished()[0].success
    assert same_bytes(storages, caches_before)
    assert torch.equal(region[~mine], region_before[~mine])


def test_cpu_backend_never_imports_triton() -> None:
    """The CPU path (torch backend) runs a store/load round trip without Triton loaded."""
    import subprocess
    import sys

    script = """
import sys
import torch
from triton_offload import GroupSpec, TransferEngine, plan_offload
from triton_offload.transfer.jobs import JobSpec
plan = plan_offload([GroupSpec("full_attention", 16)], blocks_per_chunk=2)
kv = torch.randint(0, 100, (2, 8, 4, 8), dtype=torch.int32)
before = kv.clone()
engine = TransferEngine(plan, [[(kv[0], kv[1])]], 4)
assert engine.backend == "torch"
engine.submit_store(1, JobSpec([[5, 2, 7]], [[3, 0]], [1]))
kv.zero_()
engine.submit_load(2, JobSpec([[5, 2, 7]], [[3, 0]], [1]))
assert [r.success for r in engine.get_finished()] == [True, True]
assert torch.equal(kv[:, [5, 2, 7]], before[:, [5, 2, 7]])
assert "triton" not in sys.modules, sorted(m for m in sys.modules if "triton" == m[:6])
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
