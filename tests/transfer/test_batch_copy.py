"""Batched DMA without a GPU: a recording stand-in for cuMemcpyBatchAsync behind the real
ctypes boundary, moving host bytes; and mixed jobs (some planes by one copier, the rest
by another) round-tripping byte-exactly.

The stand-in reads the descriptor arrays through the pointers the binding passes, so
what is checked is exactly what a driver would receive: one call per DMA job, and
descriptors that, expanded page by page, are the per-page addresses computed here from
the plane geometry alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.hybrid_engine import (
    BACKENDS,
    INTERPRETED,
    hybrid_caches,
    make_engine,
    same_bytes,
    snapshot,
    store_job,
)
from tests.helpers.recording_driver import RecordingDriver
from triton_offload.transfer import batch_copy
from triton_offload.transfer.copiers import DmaCopier, JobHolds
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec
from triton_offload.transfer.selection import Assignment, Crossover, CrossoverPath, PathPolicy


class _Stream:
    cuda_stream = 0x5EED


def dma_copier(engine: Any, driver: RecordingDriver) -> DmaCopier:
    return DmaCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        api=None,
        batch=batch_copy.stand_in(driver),
    )


def per_page_addresses(engine: Any, spec: JobSpec, direction: int) -> set[tuple[int, int, int]]:
    """(dst, src, page bytes) of every page of the job, from the geometry alone."""
    bpc = engine.blocks_per_chunk
    out = set()
    for group in range(engine.num_groups):
        blocks = spec.gpu_blocks[group].tolist()
        hosts = spec.host_blocks[group].tolist()
        first = spec.first_block_index[group]
        for k, block in enumerate(blocks):
            position = first % bpc + k
            row, slot = hosts[position // bpc], position % bpc
            for index in engine.layout.group_planes[group]:
                plane = engine.layout.planes[index]
                cache = plane.base_address + block * plane.block_stride
                pool = (
                    engine.pool.data_ptr()
                    + row * engine.row_stride
                    + plane.pool_offset
                    + slot * plane.page_bytes
                )
                pair = (pool, cache) if direction == TO_POOL else (cache, pool)
                out.add((*pair, plane.page_bytes))
    return out


def expand(call: dict[str, Any], page_sizes: Sequence[int]) -> set[tuple[int, int, int]]:
    """A call's descriptors cut back into pages (a merged run covers several)."""
    pages = set()
    for dst, src, size in zip(call["dsts"], call["srcs"], call["sizes"], strict=True):
        page = next(p for p in sorted(page_sizes, reverse=True) if size % p == 0)
        pages.update((dst + k * page, src + k * page, page) for k in range(size // page))
    return pages


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_one_batched_call_per_dma_job_with_the_per_page_addresses(blocks_per_chunk: int) -> None:
    gpu, host, first = store_job(blocks_per_chunk)
    runs = JobSpec(
        [[0, 1, 2], [], [8, 9]],
        [[5], [], [6]] if blocks_per_chunk == 3 else [[5, 4, 7], [], [6, 1]],
    )
    targets = [[1, 3, 8, 10], [0, 6], [2, 11, 7]]
    jobs = [
        (TO_POOL, JobSpec(gpu, host, first)),
        (TO_POOL, runs),
        (FROM_POOL, JobSpec([t[: len(g)] for t, g in zip(targets, gpu, strict=True)], host, first)),
    ]
    states = []
    for path in ("torch", "batched-dma"):
        caches, storages = hybrid_caches(seed=11)
        engine = make_engine(caches, blocks_per_chunk, "torch")
        driver = RecordingDriver()
        copier = dma_copier(engine, driver)
        assert copier.mode == "batched (stand-in)"
        page_sizes = sorted({p.page_bytes for p in engine.layout.planes})
        for job, (direction, spec) in enumerate(jobs):
            if path == "torch":
                submit = engine.submit_store if direction == TO_POOL else engine.submit_load
                submit(job, spec)
                assert engine.get_finished()[0].success
                continue
            expected = per_page_addresses(engine, spec, direction)
            table = engine.build_job_table(spec, direction)
            copier.prepare(table, direction, None, JobHolds(), _Stream())()
            assert len(driver.calls) == job + 1  # exactly one driver call per job
            call = driver.calls[-1]
            assert (call["order"], call["attr_index"], call["num_attrs"]) == (1, 0, 1)
            assert call["stream"] == _Stream.cuda_stream
            assert call["count"] == copier.last_copy_count and copier.last_call_count == 1
            assert expand(call, page_sizes) == expected
            assert sum(call["sizes"]) == sum(page for *_, page in expected)
        if path == "batched-dma" and blocks_per_chunk == 3:
            pages = len(per_page_addresses(engine, runs, TO_POOL))
            assert driver.calls[1]["count"] < pages  # adjacent K/V pages were merged
        states.append([engine.pool.clone(), *snapshot(storages)])
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))


def test_a_failed_batch_names_the_copy_and_the_job_fails() -> None:
    caches, _ = hybrid_caches()
    engine = make_engine(caches, 1, "torch")
    driver = RecordingDriver(fail_at=2)
    engine.copiers = {"dma": dma_copier(engine, driver)}
    from triton_offload.transfer.selection import FixedPath

    engine.policy = FixedPath("dma")
    pool_before = engine.pool.clone()
    gpu, host, first = store_job(1)
    assert engine.submit_store("x", gpu_blocks=gpu, host_blocks=host, first_block_index=first)
    (result,) = engine.get_finished()
    assert not result.success
    assert torch.equal(engine.pool, pool_before)
    with pytest.raises(RuntimeError, match=r"failed with CUDA error 1 at copy 2 \(stand-in\)"):
        copier = engine.copiers["dma"]
        table = engine.build_job_table(JobSpec(gpu, host, first), TO_POOL)
        copier.prepare(table, TO_POOL, None, JobHolds(), None)()


class _Driver:
    """A libcuda stand-in: cuDriverGetVersion and cuGetProcAddress_v2 as C callbacks."""

    def __init__(self, version: int, function: Any) -> None:
        self.requests: list[tuple[bytes, int]] = []

        def get_version(out: Any) -> int:
            out.contents.value = version
            return 0

        def proc_address(
            symbol: bytes, pfn: Any, cuda_version: int, flags: int, status: Any
        ) -> int:
            self.requests.append((symbol, cuda_version))
            pfn.contents.value = ctypes.cast(function, ctypes.c_void_p).value
            status.contents.value = 0
            return 0

        self.cuDriverGetVersion = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(
            get_version
        )
        self.cuGetProcAddress_v2 = ctypes.CFUNCTYPE(
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        )(proc_address)


def test_binding_asks_for_the_12_8_abi_and_falls_back_before_it() -> None:
    recorder = RecordingDriver()
    entry = batch_copy.BATCH_FUNCTION(recorder)
    driver = _Driver(13000, entry)
    batch, line = batch_copy.find_batch_copy(driver)
    assert batch is not None and line == "cuMemcpyBatchAsync, driver API 13.0"
    assert driver.requests == [(b"cuMemcpyBatchAsync", 12080)]
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    batch(
        np.array([dst.ctypes.data, dst.ctypes.data + 40], dtype=np.uint64),
        np.array([src.ctypes.data + 8, src.ctypes.data], dtype=np.uint64),
        np.array([16, 8], dtype=np.uint64),
        7,
    )
    assert dst[:16].tolist() == list(range(8, 24)) and dst[40:48].tolist() == list(range(8))
    assert recorder.calls[0]["stream"] == 7

    old, line = batch_copy.find_batch_copy(_Driver(12040, entry))
    assert old is None
    assert line == (
        "per-run cudaMemcpyAsync loop (driver API 12.4 has no cuMemcpyBatchAsync; it needs 12.8)"
    )


class _Forced(PathPolicy):
    def __init__(self, assignment: Assignment) -> None:
        self.assignment = assignment

    def assign(self, direction: int, counts: Sequence[int]) -> Assignment:
        return self.assignment


def _mixed_engine(backend: str, caches: list) -> Any:
    engine = make_engine(caches, 3, backend)
    engine.copiers["dma"] = dma_copier(engine, RecordingDriver())
    return engine


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("small_planes_by", ["dma", "kernel-or-cpu"])
def test_mixed_jobs_round_trip_byte_exact(backend: str, small_planes_by: str) -> None:
    """Planes of up to 128 bytes by one copier, the larger (Mamba SSM) ones by the other,
    forced both ways; pool and caches equal the single-copier run byte for byte."""
    gpu, host, first = store_job(3)
    targets = [[1, 3, 8, 10], [0, 6], [2, 11, 7]]
    load = JobSpec([t[: len(g)] for t, g in zip(targets, gpu, strict=True)], host, first)
    states = []
    for mixed in (False, True):
        caches, storages = hybrid_caches(seed=13)
        engine = _mixed_engine(backend, caches)
        poison = torch.Generator().manual_seed(5)
        engine.pool.copy_(
            torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8, generator=poison)
        )
        small = tuple(i for i, p in enumerate(engine.layout.planes) if p.page_bytes <= 128)
        large = tuple(i for i, p in enumerate(engine.layout.planes) if p.page_bytes > 128)
        assert small and large
        first_name, second_name = ("dma", backend) if small_planes_by == "dma" else (backend, "dma")
        if mixed:
            engine.policy = _Forced(((first_name, small), (second_name, large)))
        before = snapshot(storages)
        assert engine.submit_store("s", JobSpec(gpu, host, first))
        assert engine.get_finished()[0].success
        assert same_bytes(storages, before)
        assert engine.submit_load("l", load)
        assert engine.get_finished()[0].success
        if mixed:
            assert engine.last_job_backend == f"{first_name}+{second_name}"
            calls = engine.copiers["dma"].batch.calls
            assert calls == 2  # one batch per job, for its DMA planes only
        states.append([engine.pool.clone(), *snapshot(storages)])
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_per_plane_choice_from_the_crossover_and_tables_built_once() -> None:
    caches, storages = hybrid_caches(seed=17)
    engine = _mixed_engine("triton", caches)
    # DMA for pages of at least 500 bytes: the 528-byte SSM planes go to DMA.
    crossover = Crossover(threshold={TO_POOL: 500, FROM_POOL: 500})
    engine.policy = CrossoverPath(engine.layout, crossover, "plane")
    gpu, host, first = store_job(3)
    for job in range(2):
        assert engine.submit_store(job, JobSpec(gpu, host, first))
        assert engine.last_job_backend == "dma+triton"
        ssm = tuple(i for i, p in enumerate(engine.layout.planes) if p.page_bytes == 528)
        assert engine.last_job_assignment == (
            ("dma", ssm),
            ("triton", tuple(i for i in range(len(engine.layout.planes)) if i not in ssm)),
        )
    assert all(r.success for r in engine.get_finished())
    # The kernel's tables for the small planes were built once, not per job.
    assert len(engine.copiers["triton"]._subsets) == 1
    # A job with no Mamba blocks: every plane it moves is small, one copier.
    engine.submit_store(9, JobSpec([[4], [], []], [[7], [], []]))
    assert engine.last_job_backend == "triton"
    # Per-job choice: one copier from the mean page size of the whole job.
    engine.policy = CrossoverPath(engine.layout, crossover, "job")
    engine.submit_store(10, JobSpec(gpu, host, first))
    assert engine.last_job_assignment in ((("triton", None),), (("dma", None),))
    assert all(r.success for r in engine.get_finished())
    del storages


@pytest.mark.parametrize("backend", [*BACKENDS, "dma"])
def test_a_copier_given_some_planes_moves_only_those(backend: str) -> None:
    """A job part names a plane subset; every copier honours it (the other planes' pool
    slots keep their poison), so a mixed job never copies a plane twice or not at all."""
    caches, storages = hybrid_caches(seed=19)
    engine = _mixed_engine("torch" if backend == "dma" else backend, caches)
    small = tuple(i for i, p in enumerate(engine.layout.planes) if p.page_bytes <= 128)
    engine.policy = _Forced(((backend, small),))
    pool_before = engine.pool.clone()
    gpu, host, first = store_job(3)
    assert engine.submit_store("s", JobSpec(gpu, host, first))
    assert engine.get_finished()[0].success
    pairs, offsets = engine.last_job_table
    expected = pool_before.clone()  # the pages of the chosen planes only
    for group in range(engine.num_groups):
        for block, row, slot in pairs[offsets[group] : offsets[group + 1]].tolist():
            for index in engine.layout.group_planes[group]:
                if index in small:
                    plane = engine.layout.planes[index]
                    start = plane.pool_offset + slot * plane.page_bytes
                    expected[row, start : start + plane.page_bytes] = plane.view[block]
    assert torch.equal(engine.pool, expected), backend
    del storages
