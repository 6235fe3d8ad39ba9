"""The worker's host memory: vLLM's SharedOffloadRegion, created, locked and released.

The region must be the one vLLM's own specs create (so that capacity, sharing and
clean-up are the user's): the arguments are checked against those vLLM's
``CPUOffloadingSpec.create_worker`` and ``TieringOffloadingSpec.create_worker`` pass
for the same config, captured from vLLM's code itself. Page-locking is CUDA-only; its
choice of ranges and its roll-back are checked with a stand-in for the CUDA calls.
Also here: the configs vLLM builds that have nothing (or not everything) to move,
an attention-free model and a pipeline stage without layers of a group.
"""

from __future__ import annotations

import logging
import os
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    import triton_offload.vllm as tv
    from triton_offload.vllm import region as vllm_region

    # Imported now, before a test stands in for vLLM's region class: importing the spec
    # checks the signatures of the vLLM names it relies on, and a stand-in's would differ
    # (this file alone failed that check; the whole suite had imported the spec earlier).
    from triton_offload.vllm import spec as _spec  # noqa: F401

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"
    # Module-level names below call vLLM's classes: skip before they run.
    pytest.skip(VLLM_ERROR, allow_module_level=True)

from tests.helpers.region_config import BPC, NUM_BLOCKS, PAGE, PLANE, Caches, make_config

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")


class Captured(Exception):
    """Raised by a stand-in constructor once it recorded its arguments."""


def _capture(target: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise Captured

    monkeypatch.setattr(target, name, record)
    return calls


# ------------------------------------------------------------------ creation


@pytest.mark.parametrize(
    ("world_size", "rank", "replicated"),
    [(1, 0, False), (4, 2, False), (4, 0, True), (4, 3, True)],
)
def test_region_is_created_as_vllms_cpu_spec_creates_it(
    world_size: int, rank: int, replicated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.v1.kv_offload.cpu.shared_offload_region as region_module
    import vllm.v1.kv_offload.cpu.spec as cpu_spec_module

    config = make_config(world_size=world_size, rank=rank, replicated=replicated)
    # vLLM's CPU spec on CUDA, where it uses the region.
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    theirs = _capture(cpu_spec_module, "SharedOffloadRegion", monkeypatch)
    with pytest.raises(Captured):
        CPUOffloadingSpec(config).create_worker(Caches().canonical)
    ours = _capture(region_module, "SharedOffloadRegion", monkeypatch)
    spec = tv.TritonOffloadingSpec(config)
    spec.region_barrier = cpu_spec_module._all_workers_barrier
    with pytest.raises(Captured):
        spec.get_worker(Caches().canonical)
    assert ours == theirs
    (call,) = ours
    assert call["rank"] == (0 if replicated else rank)
    assert call["populate_shard"] == ((rank, world_size) if replicated else None)


@pytest.mark.parametrize(
    ("world_size", "rank", "replicated"), [(1, 0, False), (4, 2, False), (4, 3, True)]
)
def test_region_is_created_as_vllms_tiering_spec_creates_it(
    world_size: int, rank: int, replicated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.v1.kv_offload.cpu.shared_offload_region as region_module
    import vllm.v1.kv_offload.tiering.spec as tiering_spec_module

    config = make_config(
        world_size=world_size, rank=rank, replicated=replicated, spec_name="TieringOffloadingSpec"
    )
    theirs = _capture(tiering_spec_module, "SharedOffloadRegion", monkeypatch)
    with pytest.raises(Captured):
        TieringOffloadingSpec(config).create_worker(Caches().canonical)
    ours = _capture(region_module, "SharedOffloadRegion", monkeypatch)
    spec = tv.TritonTieringOffloadingSpec(config)
    assert spec.num_chunks == TieringOffloadingSpec(config).num_chunks
    with pytest.raises(Captured):
        spec.get_worker(Caches().canonical)
    assert ours == theirs
    # A start-up that failed publishes no plane note (nothing left in /dev/shm).
    from triton_offload.vllm.tiers import layout_note_path

    assert not os.path.exists(layout_note_path(config.engine_id, rank))


def test_worker_logs_the_region_and_shutdown_releases_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = tv.TritonOffloadingSpec(make_config())
    with caplog.at_level(logging.INFO, logger="vllm.triton_offload"):
        worker = spec.get_worker(Caches().canonical)
    region = worker.region
    path = region.mmap_path
    try:
        assert path == f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
        # No barrier outside vLLM's process groups: the creator unlinks it at shutdown.
        assert os.path.exists(path)
        message = caplog.text
        assert path in message
        assert "0.00 GiB mapped in" in message  # 8 chunks of 4 KiB
        assert "0.00 GiB page-locked in" in message  # nothing is locked on CPU
        assert "8 host chunks, row stride 4096 bytes, 4096-byte pages" in message
        assert worker.engine.pool.stride() == (4096, 1)
        assert worker.engine.pool.shape == (8, 2048)  # a group's row: 2 planes x 2 pages
    finally:
        worker.shutdown()
    assert region.mmap_obj is None and region.fd is None  # unmapped, not kept
    assert not os.path.exists(path)
    assert worker.region is None and worker.engine is None
    worker.shutdown()  # idempotent
    job = GPULoadStoreSpec([0, 1], group_sizes=[2, 0], block_indices=[0, 0])
    assert worker.submit_store(1, job, CPULoadStoreSpec([0])) is False


@pytest.mark.parametrize("spec_name", ["TritonOffloadingSpec", "TritonTieringOffloadingSpec"])
def test_shutdown_unmaps_the_region_when_chunks_are_sealed(spec_name: str) -> None:
    """With ``verify_chunks`` on (the default), the page sealer's view of the region must
    not outlive the worker: vLLM keeps a region mapped ("Keeping ... mapped: buffers are
    still exported") while any view of it exists."""
    config = make_config(spec_name=spec_name.replace("Triton", ""), extra={"verify_chunks": True})
    spec = getattr(tv, spec_name)(config)
    worker = spec.get_worker(Caches().canonical)
    region = worker.region
    assert worker.sealer is not None
    worker.shutdown()
    assert region.mmap_obj is None and region.fd is None  # unmapped, not kept
    assert not os.path.exists(region.mmap_path)


def test_a_row_that_does_not_fit_the_workers_page_is_refused() -> None:
    # Three 100-byte planes, 2 blocks per chunk: 200 bytes per plane, but each plane
    # starts on 16 bytes (208 + 208 + 200, rounded to 624) in the worker's 600.
    tensors = [torch.zeros(NUM_BLOCKS, 100, dtype=torch.int8) for _ in range(3)]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 100) for t in tensors],
        [[CanonicalKVCacheRef(i, 100) for i in range(3)]],
    )
    spec = tv.TritonOffloadingSpec(make_config(groups=1, worker_bytes=300, cpu_bytes=PAGE))
    with pytest.raises(ValueError, match=r"needs 624 bytes .* gives each worker 600 bytes"):
        spec.get_worker(caches)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap")


# ------------------------------------------------------------------ locking


def test_lock_ranges_take_the_workers_pages_when_that_saves_enough() -> None:
    mib = 1 << 20
    plan = vllm_region.RegionPlan(
        engine_id="e", num_chunks=2, row_stride=8 * mib, cpu_page_size=mib + 100,
        rank=2, world_size=4, replicated=False,
    )  # fmt: skip
    # Row k, page 2: [k * 8 MiB + 2 MiB + 200, + 1 MiB + 100), rounded out to 4 KiB.
    assert vllm_region.lock_ranges(plan) == [
        (2 * mib, mib + PAGE),
        (8 * mib + 2 * mib, mib + PAGE),
    ]


def test_lock_ranges_take_whole_rows_when_the_rest_of_a_row_is_small() -> None:
    plan = vllm_region.RegionPlan(
        engine_id="e", num_chunks=8, row_stride=3 * PAGE, cpu_page_size=PAGE,
        rank=1, world_size=3, replicated=False,
    )  # fmt: skip
    # 8 rows of 12 KiB in pieces of at most 7 rows' worth rounded down to whole rows.
    assert vllm_region.lock_ranges(plan, piece_bytes=7 * 3 * PAGE + 100) == [
        (0, 7 * 3 * PAGE),
        (7 * 3 * PAGE, 3 * PAGE),
    ]
    assert vllm_region.lock_ranges(plan, piece_bytes=1) == [
        (row * 3 * PAGE, 3 * PAGE) for row in range(8)
    ]


class FakeCuda:
    """Records registrations; maps host address a to device address a + shift(a)."""

    def __init__(self, shift: Any = lambda address: 0x1000, fail_at: int | None = None) -> None:
        self.shift = shift
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> None:
        if len(self.registered) == self.fail_at:
            raise RuntimeError("registering failed with CUDA error 1")
        self.registered.append((address, size))

    def device_pointer(self, address: int) -> int:
        return address + self.shift(address)

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def _fake_region(total: int) -> Any:
    backing = torch.zeros(total, dtype=torch.int8)
    return SimpleNamespace(base_tensor=backing, pinned_addresses=[], is_pinned=False)


PLAN = vllm_region.RegionPlan(
    engine_id="e", num_chunks=4, row_stride=PAGE, cpu_page_size=PAGE,
    rank=0, world_size=1, replicated=False,
)  # fmt: skip


def test_locking_records_the_pieces_for_the_regions_cleanup() -> None:
    region = _fake_region(PLAN.total_bytes)
    cuda = FakeCuda()
    assert vllm_region.lock_worker_pages(region, PLAN, cuda, piece_bytes=2 * PAGE) == 4 * PAGE
    base = region.base_tensor.data_ptr()
    assert cuda.registered == [(base, 2 * PAGE), (base + 2 * PAGE, 2 * PAGE)]
    assert region.pinned_addresses == [base, base + 2 * PAGE]
    assert region.is_pinned and cuda.unregistered == []


def test_locking_rolls_back_when_a_piece_fails() -> None:
    region = _fake_region(PLAN.total_bytes)
    cuda = FakeCuda(fail_at=2)
    with pytest.raises(RuntimeError, match="CUDA error 1"):
        vllm_region.lock_worker_pages(region, PLAN, cuda, piece_bytes=PAGE)
    assert cuda.unregistered == [address for address, _ in reversed(cuda.registered)]
    assert region.pinned_addresses == [] and not region.is_pinned


def test_locking_needs_one_linear_device_mapping() -> None:
    region = _fake_region(PLAN.total_bytes)
    base = region.base_tensor.data_ptr()
    cuda = FakeCuda(shift=lambda address: 0 if address == base else 1 << 30)
    with pytest.raises(RuntimeError, match=r"offset 4096 .* one linear device mapping"):
        vllm_region.lock_worker_pages(region, PLAN, cuda, piece_bytes=PAGE)
    assert cuda.unregistered == [base + PAGE, base]
    assert not region.is_pinned


# ------------------------------------------------------------------ ledger


def test_ledger_reports_a_job_once_every_chunk_holds_it() -> None:
    engine_id = f"ledger-{uuid.uuid4()}"
    writer = vllm_region.StoreLedger(engine_id, 5, None)
    reader = vllm_region.StoreLedger(engine_id, 5, None)  # a second mapping of one file
    try:
        chunks = np.array([1, 3])
        assert reader.status(chunks, 0) is None
        writer.publish(np.array([1]), 0, True)
        assert reader.status(chunks, 0) is None  # chunk 3 not yet
        writer.publish(np.array([3]), 0, True)
        assert reader.status(chunks, 0) is True
        assert reader.status(chunks, 1) is None  # another job over the same chunks
        writer.publish(chunks, 1, False)
        assert reader.status(chunks, 1) is False
        assert reader.status(np.zeros(0, dtype=np.int64), 9) is True
    finally:
        reader.close()
        writer.close()


def test_replicated_store_job_ids_must_be_ints() -> None:
    spec = tv.TritonOffloadingSpec(make_config(world_size=2, rank=1, replicated=True))
    caches = Caches()
    worker = spec.get_worker(caches.canonical)
    try:
        assert worker.writer is False and worker.ledger is not None
        job = GPULoadStoreSpec([0, 1], group_sizes=[2, 0], block_indices=[0, 0])
        with pytest.raises(TypeError, match=r"store job ids must be ints.*'a'"):
            worker.submit_store("a", job, CPULoadStoreSpec([0]))
        with pytest.raises(ValueError, match=r"GPU block id 9 of group 0"):
            bad = GPULoadStoreSpec([0, 9], group_sizes=[2, 0], block_indices=[0, 0])
            worker.submit_store(1, bad, CPULoadStoreSpec([0]))
        # Rank 0 has not written job 2: a non-writer reports nothing yet.
        assert worker.submit_store(2, job, CPULoadStoreSpec([0]))
        assert worker.get_finished() == []
        worker.ledger.publish(np.array([0]), 2, True)
        assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
            (2, True, 0)
        ]
    finally:
        worker.shutdown()


# ------------------------------------------------------------------ configs


def test_attention_free_config_builds_and_counts_as_vllms_cpu_spec() -> None:
    config = make_config(groups=0, worker_bytes=8, cpu_bytes=65536)
    theirs = CPUOffloadingSpec(config)
    spec = tv.TritonOffloadingSpec(config)
    assert spec.plan is None
    assert spec.num_chunks == theirs.num_chunks > 0
    assert spec.get_manager().config_info() == theirs.get_manager().config_info()
    (info,) = spec.get_manager().config_info()
    assert info["cpu_kv_cache_size_tokens"] == "None"  # no group whose chunk to count
    worker = spec.get_worker(CanonicalKVCaches(tensors=[], group_data_refs=[]))
    assert worker.engine is None and worker.region is None  # nothing mapped
    empty = GPULoadStoreSpec([], group_sizes=[], block_indices=[])
    assert worker.submit_store(1, empty, CPULoadStoreSpec([]))
    assert worker.submit_load(2, CPULoadStoreSpec([]), empty)
    assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
        (1, True, 0),
        (2, True, 0),
    ]
    with pytest.raises(ValueError, match=r"1 group sizes.*0 groups"):
        one = GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0])
        worker.submit_store(3, one, CPULoadStoreSpec([0]))
    worker.shutdown()


def test_a_stage_without_layers_of_a_group_moves_the_others() -> None:
    spec = tv.TritonOffloadingSpec(make_config(groups=3))
    caches = Caches(groups=3, empty=(1,))
    worker = spec.get_worker(caches.canonical)
    try:
        assert worker.stage_groups == (0, 2)
        engine = worker.engine
        raw = worker.region.base_tensor.view(torch.uint8).view(spec.num_chunks, -1)
        raw.fill_(0x5A)
        before = raw.clone()
        # Group 0: blocks 4, 5 -> chunk 3; group 1 (not here): 2 blocks -> chunk 6;
        # group 2: block 7 at logical block 1 -> chunk 2 slot 1.
        job = GPULoadStoreSpec([4, 5, 0, 1, 7], group_sizes=[2, 2, 1], block_indices=[0, 0, 1])
        assert worker.submit_store(1, job, CPULoadStoreSpec([3, 6, 2]))
        (result,) = worker.get_finished()
        assert (result.success, result.transfer_size) == (True, 3 * 2 * PLANE)
        expected = before.clone()
        for chunk, slot, block, tensors in [
            (3, 0, 4, (0, 1)),
            (3, 1, 5, (0, 1)),
            (2, 1, 7, (4, 5)),
        ]:
            for plane, tensor in enumerate(tensors):
                start = plane * BPC * PLANE + slot * PLANE
                expected[chunk, start : start + PLANE] = caches.tensors[tensor][block].view(
                    torch.uint8
                )
        assert torch.equal(raw, expected)  # chunk 6 untouched
        with pytest.raises(ValueError, match=r"host block id 8 of group 1 out of range \[0, 8\)"):
            worker.submit_store(2, job, CPULoadStoreSpec([3, 8, 2]))
        # The engine covers every group; the empty one moves nothing (no planes).
        assert engine.num_groups == 3 and engine.layout.group_planes[1] == ()
        del raw
    finally:
        worker.shutdown()


def test_the_plugin_registers_both_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name in (tv.SPEC_NAME, tv.TIERING_SPEC_NAME):
        monkeypatch.delitem(OffloadingSpecFactory._registry, name, raising=False)
    tv.register()
    tv.register()  # twice in one process: no error
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": tv.TIERING_SPEC_NAME}) is (
        tv.TritonTieringOffloadingSpec
    )
    assert issubclass(tv.TritonTieringOffloadingSpec, TieringOffloadingSpec)


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "dma"])
def test_cuda_worker_locks_its_pages_and_moves_them(backend: str) -> None:
    """On CUDA the region is page-locked, reached by the kernels, and unlocked at shutdown."""
    spec = tv.TritonOffloadingSpec(make_config(extra={"backend": backend}))
    caches = Caches()
    for index, tensor in enumerate(caches.tensors):
        caches.tensors[index] = tensor.cuda()
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PLANE) for t in caches.tensors],
        group_data_refs=caches.canonical.group_data_refs,
    )
    worker = spec.get_worker(canonical)
    region = worker.region
    try:
        assert region.is_pinned and region.pinned_addresses
        assert worker.engine._pool.pinned and worker.engine._pool.locked_by == "cudaHostRegister"
        raw = region.base_tensor.view(torch.uint8).view(spec.num_chunks, -1)
        raw.fill_(0x5A)
        before = raw.clone()
        job = GPULoadStoreSpec([4, 5, 7], group_sizes=[2, 1], block_indices=[0, 1])
        assert worker.submit_store(1, job, CPULoadStoreSpec([3, 2]))
        worker.wait({1})
        (result,) = worker.get_finished()
        assert result.success
        torch.cuda.synchronize()
        expected = before.clone()
        for chunk, slot, block, tensors in [
            (3, 0, 4, (0, 1)),
            (3, 1, 5, (0, 1)),
            (2, 1, 7, (2, 3)),
        ]:
            for plane, tensor in enumerate(tensors):
                start = plane * BPC * PLANE + slot * PLANE
                expected[chunk, start : start + PLANE] = (
                    caches.tensors[tensor][block].cpu().view(torch.uint8)
                )
        assert torch.equal(raw, expected)
        sources = [t.clone() for t in caches.tensors]
        for tensor in caches.tensors:
            tensor[[0, 1, 2]] = 0x11
        load = GPULoadStoreSpec([0, 1, 2], group_sizes=[2, 1], block_indices=[0, 1])
        assert worker.submit_load(2, CPULoadStoreSpec([3, 2]), load)
        worker.wait({2})
        (result,) = worker.get_finished()
        assert result.success
        torch.cuda.synchronize()
        for tensor, source, blocks in [(0, 0, (4, 5)), (1, 1, (4, 5)), (2, 2, (7,)), (3, 3, (7,))]:
            for target, block in zip((0, 1) if len(blocks) == 2 else (2,), blocks, strict=True):
                assert torch.equal(caches.tensors[tensor][target], sources[source][block])
        del raw, before, expected
    finally:
        worker.shutdown()
    assert not region.is_pinned and region.pinned_addresses == []


def test_the_writer_publishes_finished_stores_before_shutting_down() -> None:
    spec = tv.TritonOffloadingSpec(make_config(world_size=2, rank=0, replicated=True))
    worker = spec.get_worker(Caches().canonical)
    reader = vllm_region.StoreLedger(spec.config.engine_id, spec.num_chunks, None)
    try:
        assert worker.writer is True
        job = GPULoadStoreSpec([0, 1], group_sizes=[2, 0], block_indices=[0, 0])
        assert worker.submit_store(4, job, CPULoadStoreSpec([5]))
        assert reader.status(np.array([5]), 4) is None  # published when reported
        worker.shutdown()
        assert reader.status(np.array([5]), 4) is True
    finally:
        worker.shutdown()
        reader.close()


def test_unlocking_uses_the_binding_that_locked() -> None:
    region = _fake_region(PLAN.total_bytes)
    cuda = FakeCuda()
    vllm_region.lock_worker_pages(region, PLAN, cuda, piece_bytes=2 * PAGE)
    locked = list(region.pinned_addresses)
    vllm_region.unlock_worker_pages(region, cuda)
    assert cuda.unregistered == locked[::-1]
    assert region.pinned_addresses == [] and not region.is_pinned
    vllm_region.unlock_worker_pages(region, cuda)  # idempotent
    assert cuda.unregistered == locked[::-1]


@pytest.mark.parametrize(("world_size", "rank", "replicated"), [(4, 3, True), (4, 3, False)])
def test_ranks_sharing_rows_calibrate_on_their_own_slice(
    world_size: int, rank: int, replicated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under the single-copy layout every rank's pool is the same rows: the start-up
    # calibration of one rank must not store into rows another rank calibrates on.
    import triton_offload.vllm.spec as spec_module

    config = make_config(world_size=world_size, rank=rank, replicated=replicated)
    spec = tv.TritonOffloadingSpec(config)
    spec.region_barrier = lambda: None  # this process stands for every rank
    calls: list[dict[str, Any]] = []

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise Captured

    monkeypatch.setattr(spec_module, "TransferEngine", record)
    with pytest.raises(Captured):
        spec.get_worker(Caches().canonical)
    (call,) = calls
    assert call["calibration_rows"] == ((rank, world_size) if replicated else (0, 1))


def test_a_non_writer_stops_waiting_for_a_writer_that_never_publishes() -> None:
    """Replicated layout, rank 0 died before copying: another rank's wait() on that store
    returns after the bound (``replicated_store_timeout_s``) and the job is reported
    failed, once; the worker keeps serving."""
    config = make_config(world_size=2, rank=1, replicated=True)
    config.extra_config["replicated_store_timeout_s"] = 0.2
    spec = tv.TritonOffloadingSpec(config)
    worker = spec.get_worker(Caches().canonical)
    try:
        job = GPULoadStoreSpec([0, 1], group_sizes=[2, 0], block_indices=[0, 0])
        assert worker.submit_store(7, job, CPULoadStoreSpec([0]))
        assert worker.get_finished() == []  # within the bound: still waiting
        worker.wait([7])  # returns once the bound passed
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, False)]
        assert worker.get_finished() == []
        assert worker.submit_store(8, job, CPULoadStoreSpec([1]))
        worker.ledger.publish(np.array([1]), 8, True)
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(8, True)]
    finally:
        worker.shutdown()


@pytest.mark.parametrize("value", [0, -1, "5", True])
def test_the_replicated_store_timeout_is_checked(value: object) -> None:
    config = make_config(world_size=2, rank=1, replicated=True)
    config.extra_config["replicated_store_timeout_s"] = value
    with pytest.raises((TypeError, ValueError), match="replicated_store_timeout_s"):
        tv.TritonOffloadingSpec(config)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_no_region_file_is_left_when_start_up_is_interrupted_at_the_barrier(
    interrupt: type[BaseException],
) -> None:
    """A rank interrupted while it waits at the workers' barrier (Ctrl-C, or SIGTERM's
    SystemExit) leaves no file in /dev/shm: vLLM's own clean-up catches Exception only."""
    import glob

    engine_id = f"interrupted-{uuid.uuid4()}"
    plan = vllm_region.RegionPlan(
        engine_id=engine_id, num_chunks=4, row_stride=PAGE, cpu_page_size=PAGE,
        rank=0, world_size=1, replicated=False,
    )  # fmt: skip

    def barrier() -> None:
        raise interrupt

    with pytest.raises(interrupt):
        vllm_region.create_worker_region(plan, barrier=barrier)
    assert glob.glob(f"/dev/shm/vllm_offload_{engine_id}*") == []


def test_a_joiner_whose_barrier_fails_removes_a_dead_creators_files() -> None:
    """The rank that created the region died before the barrier (its files stay: vLLM
    removes them only from the creating rank); another rank's barrier then fails (a
    collective timeout). Start-up cannot succeed, so that rank removes the files."""
    import glob

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    engine_id = f"dead-creator-{uuid.uuid4()}"
    creator = SharedOffloadRegion(
        engine_id=engine_id, num_chunks=4, rank=0, kv_bytes_per_chunk=2 * PAGE,
        cpu_page_size=PAGE,
    )  # fmt: skip
    plan = vllm_region.RegionPlan(
        engine_id=engine_id, num_chunks=4, row_stride=2 * PAGE, cpu_page_size=PAGE,
        rank=1, world_size=2, replicated=False,
    )  # fmt: skip

    def barrier() -> None:
        raise RuntimeError("barrier timed out: rank 0 is gone")

    try:
        with pytest.raises(RuntimeError, match="rank 0 is gone"):
            vllm_region.create_worker_region(plan, barrier=barrier)
        assert glob.glob(f"/dev/shm/vllm_offload_{engine_id}*") == []
    finally:
        creator.cleanup()
