"""vLLM's ``canonical_layout`` through this project's copy paths, judged by vLLM itself.

For each geometry the caches of every rank are registered with vLLM's own
``OffloadingConnectorWorker.register_kv_caches`` (so the ``CanonicalKVCaches`` and their
``CopyRun`` mappings come from ``derive_canonical_mappings``), and vLLM's own descriptor
code (``SingleDirectionOffloadingHandler._fill_canonical_ops`` with its writer rotation,
on CPU tensors carved by ``SharedOffloadRegion.create_next_canonical_view``) is replayed
with ``ctypes.memmove`` as the judge: vLLM's CUDA worker cannot run on CPU (it asserts
CUDA tensors), its descriptors can. This project's fragment planes are copied by the
kernel (interpreted), the CPU path and the DMA path (host memmove stand-in for the batch
driver call). Stores: the pool after each rank's store equals the judge's (pages a rank
does not write stay poisoned), caches unchanged. Loads: the poisoned GPU blocks equal
the judge's, pool unchanged. All comparisons are ``torch.equal``.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    from tests.helpers.vllm_canonical_judge import (
        BPC,
        NUM_BLOCKS,
        Geometry,
        vllm_canonical_caches,
        vllm_replay,
    )

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"
    # Module-level names below use vLLM's geometry helpers: skip before they run.
    pytest.skip(VLLM_ERROR, allow_module_level=True)

from tests.helpers.recording_driver import RecordingDriver
from triton_offload.transfer import batch_copy
from triton_offload.transfer.copiers import DmaCopier, HostCopier, JobHolds, TritonCopier
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec, pair_table

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

CHUNKS = 5
POISON = 0xA5


GEOMETRIES = [
    Geometry("hnd-tp1", "hnd", total_heads=2, tp=1),
    Geometry("hnd-tp2", "hnd", total_heads=4, tp=2),
    Geometry("nhd-tp2", "nhd", total_heads=4, tp=2),
    Geometry("split-nhd-tp2", "split_nhd", total_heads=2, tp=2),
    Geometry("split-hnd-tp2", "split_hnd", total_heads=4, tp=2),
    Geometry("mla-tp2-writers", "mla", total_heads=1, tp=2),
    Geometry("heads-fewer-than-tp", "hnd", total_heads=2, tp=4),
    Geometry("nhd-dcp2", "nhd", total_heads=1, tp=2, dcp=2),
    Geometry("hnd-pcp2-interleave2", "hnd", total_heads=2, tp=1, pcp=2, interleave=2),
    Geometry("mla-tp4-dcp2", "mla", total_heads=1, tp=4, dcp=2),
    Geometry("two-groups-split-hnd", "split_hnd", total_heads=4, tp=2, groups=2),
]


def run_path(path: str, layout: Any, pool: torch.Tensor, job: JobSpec, direction: int) -> None:
    """One job through one of this project's copy paths on ``layout``'s fragment planes."""
    address, stride = pool.data_ptr(), pool.stride(0)
    table = pair_table(layout, pool.size(0), job, direction)
    copier: Any
    if path == "cpu":
        copier = HostCopier(layout, address, stride)
    elif path == "dma":
        driver = RecordingDriver()
        copier = DmaCopier(layout, address, stride, api=None, batch=batch_copy.stand_in(driver))
    else:
        copier = TritonCopier(layout, address, stride, device=torch.device("cpu"), cuda=False)
    copier.prepare(table, direction, None, JobHolds(), types.SimpleNamespace(cuda_stream=0))()


def job_for(geometry: Geometry, seed: int) -> tuple[JobSpec, JobSpec]:
    """(store, load) jobs: a partial first chunk, random blocks, distinct rows per group."""
    rng = np.random.default_rng(seed)
    stores, loads = [], []
    rows = rng.permutation(CHUNKS)
    for group in range(geometry.groups):
        first = 1 + group  # slot 1 (2) of the first chunk
        count = 2 * BPC - first % BPC - (group == 1)
        chunks = -(-(first % BPC + count) // BPC)
        hosts = rows[group * 2 : group * 2 + chunks]
        stores.append((rng.permutation(NUM_BLOCKS)[:count], hosts, first))
        loads.append((rng.permutation(NUM_BLOCKS)[:count], hosts, first))
    return JobSpec.from_groups(stores), JobSpec.from_groups(loads)


PATHS = [
    "cpu",
    "dma",
    pytest.param(
        "kernel",
        marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.name)
def test_canonical_copies_equal_vllms_descriptor_replay(geometry: Geometry, path: str) -> None:
    from triton_offload.vllm.canonical import canonical_cache_layout

    ranks = [vllm_canonical_caches(geometry, rank, seed=rank) for rank in range(geometry.world)]
    layouts = [canonical_cache_layout(kv, BPC) for kv, _ in ranks]
    row_bytes = layouts[0].row_bytes
    assert all(layout.row_bytes == row_bytes for layout in layouts)
    # vLLM's rows are wider than the canonical area (page alignment): a row stride of
    # its own, bytes past the area stay poisoned too.
    stride = row_bytes + 40
    judge = torch.full((CHUNKS * stride,), POISON, dtype=torch.uint8)
    ours = judge.clone()
    judge_pool = judge.as_strided((CHUNKS, row_bytes), (stride, 1))
    our_pool = ours.as_strided((CHUNKS, row_bytes), (stride, 1))
    store, load = job_for(geometry, seed=len(geometry.name))
    writers = {plane.num_writers for layout in layouts for plane in layout.planes}
    for (kv_caches, tensors), layout in zip(ranks, layouts, strict=True):
        before = [t.clone() for t in tensors]
        vllm_replay(kv_caches, judge_pool, store, store=True)
        run_path(path, layout, our_pool, store, TO_POOL)
        # After each rank: its pages only (writer rotation leaves the rest poisoned).
        assert torch.equal(ours, judge)
        # Compared as bits: random bf16 patterns include NaNs.
        assert all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(tensors, before, strict=True)
        )
    assert not torch.equal(judge, torch.full_like(judge, POISON))
    if max(writers) > 1:
        # Every canonical page was written exactly once by the ranks together; a
        # single writer alone would have left pages poisoned (checked above per rank).
        assert geometry.world > 1
    pool_before = ours.clone()
    for (kv_caches, tensors), layout in zip(ranks, layouts, strict=True):
        for tensor in tensors:
            tensor.view(torch.int16).fill_(-1)
        vllm_replay(kv_caches, judge_pool, load, store=False)
        expected = [t.tensor.clone() for t in kv_caches.tensors]
        for tensor in tensors:
            tensor.view(torch.int16).fill_(-1)
        run_path(path, layout, our_pool, load, FROM_POOL)
        actual = [t.tensor for t in kv_caches.tensors]
        assert all(torch.equal(a, b) for a, b in zip(actual, expected, strict=True))
    assert torch.equal(ours, pool_before)


def test_a_store_of_one_writer_leaves_the_other_writers_pages_poisoned() -> None:
    """MLA at TP 2: rank 1 writes only odd canonical pages (p = row * bpc + slot)."""
    from triton_offload.vllm.canonical import canonical_cache_layout

    geometry = Geometry("mla", "mla", total_heads=1, tp=2)
    kv_caches, _ = vllm_canonical_caches(geometry, rank=1, seed=5)
    layout = canonical_cache_layout(kv_caches, BPC)
    assert {(p.num_writers, p.writer_index) for p in layout.planes} == {(2, 1)}
    pool = torch.full((CHUNKS, layout.row_bytes), POISON, dtype=torch.uint8)
    job = JobSpec([np.arange(BPC * 2)], [np.array([0, 1])], [0])
    run_path("cpu", layout, pool, job, TO_POOL)
    page = layout.planes[0].pool_slot_stride
    for row in (0, 1):
        for slot in range(BPC):
            written = not torch.equal(
                pool[row, slot * page : (slot + 1) * page],
                torch.full((page,), POISON, dtype=torch.uint8),
            )
            assert written == ((row * BPC + slot) % 2 == 1), (row, slot)


# ------------------------------------------------------------------ the spec


def _tiering_config(spec_name: str, rank: int, engine_id: str, **changes: Any) -> Any:
    import dataclasses

    from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingGroupConfig

    from tests.helpers.tiering_config import _parallel, make_config

    geometry = GEOMETRIES[1]  # hnd-tp2
    page = 2 * geometry.block_size * 2 * geometry.head_size * 2  # heads x bs x 2 hs x bf16
    base = make_config(
        __import__("pathlib").Path("/nonexistent"),
        spec_name,
        tiers=[],
        parallel=dataclasses.replace(_parallel(geometry.tp, agnostic=True), rank=rank),
        canonical_layout=True,
        kv_cache_layout="LBHNC",
        worker_kv_bytes_per_block=geometry.layers * page,
        engine_id=engine_id,
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=geometry.block_size,
                layer_names=tuple(f"g0.layer{i}" for i in range(geometry.layers)),
                group_id=0,
            ),
        ),
        **changes,
    )
    extra = {**base.extra_config, "cpu_bytes_to_use": CHUNKS * 4096, "backend": "torch"}
    extra.update(canonical_layout=True)
    return dataclasses.replace(base, extra_config=extra)


def test_tiering_spec_with_canonical_layout_stores_stock_vllms_rows() -> None:
    """Two ranks' workers store into one region; its rows equal what vLLM's stock tiering
    worker writes (its descriptors replayed: its CUDA worker cannot run on CPU) into rows
    of the stock spec's own stride, and a load brings the blocks back."""
    import uuid

    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    geometry = GEOMETRIES[1]
    engine_id = f"canonical-{uuid.uuid4()}"
    stock = OffloadingSpecFactory.create_spec(
        _tiering_config("TieringOffloadingSpec", 0, engine_id)
    )
    specs = [
        OffloadingSpecFactory.create_spec(
            _tiering_config("TritonTieringOffloadingSpec", rank, engine_id)
        )
        for rank in range(geometry.world)
    ]
    assert all(spec.stock_rows and spec.storage_layout is None for spec in specs)
    assert specs[0].config.model.dtype == stock.config.model.dtype == "bfloat16"
    stride = stock.kv_bytes_per_chunk
    assert specs[0].kv_bytes_per_chunk == stride and specs[0].num_chunks == stock.num_chunks
    ranks = [vllm_canonical_caches(geometry, rank, seed=rank) for rank in range(geometry.world)]
    workers = [spec.get_worker(kv) for spec, (kv, _) in zip(specs, ranks, strict=True)]
    try:
        rows = workers[0].region.base_tensor.view(torch.uint8).view(stock.num_chunks, stride)
        rows.fill_(POISON)
        judge = torch.full((stock.num_chunks * stride,), POISON, dtype=torch.uint8)
        judge_rows = judge.view(stock.num_chunks, stride)
        store, load = job_for(geometry, seed=9)
        (blocks,), (hosts,), (first,) = store.gpu_blocks, store.host_blocks, store.first_block_index
        gpu_spec = GPULoadStoreSpec(blocks.tolist(), [blocks.size], [first])
        for rank, worker in enumerate(workers):
            assert worker.submit_store(rank, gpu_spec, CPULoadStoreSpec(hosts.tolist()))
            worker.wait({rank})
            assert [(r.job_id, r.success) for r in worker.get_finished()] == [(rank, True)]
            area = judge_rows[:, : workers[0].engine.row_bytes]
            vllm_replay(ranks[rank][0], area, store, store=True)
            assert torch.equal(rows, judge_rows)
        (blocks,), (hosts,), (first,) = load.gpu_blocks, load.host_blocks, load.first_block_index
        for rank, (worker, (kv_caches, tensors)) in enumerate(zip(workers, ranks, strict=True)):
            for tensor in tensors:
                tensor.view(torch.int16).fill_(-1)
            vllm_replay(kv_caches, judge_rows[:, : worker.engine.row_bytes], load, store=False)
            expected = [t.tensor.clone() for t in kv_caches.tensors]
            for tensor in tensors:
                tensor.view(torch.int16).fill_(-1)
            spec = GPULoadStoreSpec(blocks.tolist(), [blocks.size], [first])
            assert worker.submit_load(10 + rank, CPULoadStoreSpec(hosts.tolist()), spec)
            worker.wait({10 + rank})
            assert [r.success for r in worker.get_finished()] == [True]
            assert all(
                torch.equal(t.tensor, e) for t, e in zip(kv_caches.tensors, expected, strict=True)
            )
        del rows
    finally:
        for worker in workers:
            worker.shutdown()


def test_canonical_storage_names_are_stock_vllms_and_kvcr_is_accepted() -> None:
    import uuid

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.file_mapper import FileMapper

    engine_id = f"canonical-{uuid.uuid4()}"
    stock = OffloadingSpecFactory.create_spec(
        _tiering_config("TieringOffloadingSpec", 0, engine_id)
    )
    ours = OffloadingSpecFactory.create_spec(
        _tiering_config("TritonTieringOffloadingSpec", 0, engine_id)
    )
    paths = [
        FileMapper.from_offloading_spec("/tmp/x", spec, 3, parallel_agnostic=True).base_path
        for spec in (stock, ours)
    ]
    assert paths[0] == paths[1]
    tiers = [{"type": "kvcr", "control_ports": [1]}]
    config = _tiering_config("TritonTieringOffloadingSpec", 0, engine_id)
    import dataclasses

    config = dataclasses.replace(
        config, extra_config={**config.extra_config, "secondary_tiers": tiers}
    )
    assert OffloadingSpecFactory.create_spec(config).stock_rows
    cpu = _tiering_config("TritonOffloadingSpec", 0, engine_id)
    with pytest.raises(
        ValueError, match="canonical_layout'\\] is not supported by TritonOffloadingSpec"
    ):
        OffloadingSpecFactory.create_spec(cpu)


def test_a_ref_without_mapping_fails_closed_naming_the_layer() -> None:
    import dataclasses
    import uuid

    from triton_offload.vllm.canonical import canonical_cache_layout

    kv_caches, _ = vllm_canonical_caches(GEOMETRIES[1], rank=0, seed=1)
    kv_caches.group_data_refs[0][1] = dataclasses.replace(
        kv_caches.group_data_refs[0][1], mapping=None
    )
    with pytest.raises(ValueError, match=r"layer 'g0\.layer1'.*no canonical mapping.*pipeline"):
        canonical_cache_layout(kv_caches, BPC, layer_names=[["g0.layer0", "g0.layer1"]])
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(
        _tiering_config("TritonTieringOffloadingSpec", 0, f"canonical-{uuid.uuid4()}")
    )
    with pytest.raises(ValueError, match=r"layer 'g0\.layer1'.*no canonical mapping"):
        spec.get_worker(kv_caches)


def test_canonical_layout_warns_that_checkpoints_are_not_kept_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stock names and unsealed rows: a start-up warning says another checkpoint under the
    same model name would be handed these chunks, and what keeps them apart."""
    import uuid

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = _tiering_config("TritonTieringOffloadingSpec", 0, f"canonical-{uuid.uuid4()}")
    config = dataclasses.replace(
        config, extra_config={**config.extra_config, "checkpoint_id": "weights-v1"}
    )
    with caplog.at_level("WARNING", logger="vllm.triton_offload"):
        spec = OffloadingSpecFactory.create_spec(config)
    assert spec.stock_rows
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    named = [line for line in lines if "checkpoint id:weights-v1 is not part of" in line]
    assert named and "own model path or its own tier roots" in named[0], lines
