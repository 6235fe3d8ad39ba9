"""Worker processes of one engine sharing vLLM's region through TritonOffloadingSpec.

Two and four real processes (forked from the test process, which has already imported
vLLM and the engine, so each starts in milliseconds) build the spec for ranks
``0..n-1`` of one engine id and meet at a real ``multiprocessing.Barrier`` wherever
vLLM's workers meet at theirs. Every rank gets the same store job (the scheduler hands
every worker the same chunk ids), stores its own pages, and then loads them back into
other GPU blocks. The test process judges every byte: the whole region (poisoned
worker pages, untouched padding, addressed pages at the place the row-layout rule
gives) and every rank's GPU caches after the load.

With ``replicated_layout`` there is one copy per chunk: only rank 0 copies, the other
ranks hold *different* bytes in their caches (so a rank that wrongly copied would show
in the region) and report the store only once the ledger says rank 0's copy is there;
every rank then loads rank 0's bytes. Both specs run it: ``TritonTieringOffloadingSpec``
maps the region as vLLM's tiering worker does (no barrier; it stays linked until its
creator shuts down, since vLLM's scheduler maps it too).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
import uuid
from typing import Any

import pytest
import torch

from tests.helpers.vllm_fixtures import hybrid_groups, offloading_config, round_up

try:
    import triton_offload.kernels.copy_blocks
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    import triton_offload.transfer.engine  # noqa: F401  (imported once here, not in every child)
    import triton_offload.vllm as tv

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

PAGE = 4096
NUM_BLOCKS = 12
BPC = 2
NUM_CHUNKS = 8
# Per block: a 128-byte tensor shared by an attention layer (whole page) and a Mamba
# conv state (76 real bytes), a 160-byte block holding a 96-byte attention page, and
# a 48-byte block holding a 40-byte Mamba SSM page.
WORKER_BYTES = 128 + 160 + 48
CPU_PAGE = WORKER_BYTES * BPC
# (group, plane) -> (tensor index, page bytes), in ref order.
PLANES = {(0, 0): (0, 128), (0, 1): (1, 96), (1, 0): (0, 76), (1, 1): (2, 40)}
# The job every rank gets: attention blocks 5, 2, 9 from logical block 1 (chunks
# C0 slot 1, C1 slots 0-1), Mamba block 7 at logical block 3 (chunk C2 slot 1).
STORE_BLOCKS = [5, 2, 9, 7]
LOAD_BLOCKS = [0, 11, 4, 8]
GROUP_SIZES = [3, 1]
BLOCK_INDICES = [1, 3]
CHUNKS = [6, 1, 4]
# (group, job position) -> (chunk, slot)
PLACES = [(0, CHUNKS[0], 1), (0, CHUNKS[1], 0), (0, CHUNKS[1], 1), (1, CHUNKS[2], 1)]
POISON_GPU = 0x33
TIMEOUT_S = 60


def row_stride(world_size: int, replicated: bool) -> int:
    return round_up(CPU_PAGE * (1 if replicated else world_size), PAGE)


def make_config(
    rank: int, world_size: int, replicated: bool, engine_id: str, spec_name: str
) -> OffloadingConfig:
    return offloading_config(
        groups=hybrid_groups(),
        worker_bytes=WORKER_BYTES,
        blocks_per_chunk=BPC,
        extra_config={
            "spec_name": spec_name,
            "cpu_bytes_to_use": NUM_CHUNKS * row_stride(world_size, replicated),
            "verify_chunks": False,  # the copy is judged here; seals in test_integrity.py
            "backend": "torch",
        },
        engine_id=engine_id,
        rank=rank,
        world_size=world_size,
        replicated=replicated,
    )


def make_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-128, 128, (NUM_BLOCKS, size), dtype=torch.int8, generator=generator)
        for size in (128, 160, 48)
    ]


def canonical(tensors: list[torch.Tensor]) -> CanonicalKVCaches:
    shared, strided, ssm = tensors
    return CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(shared, 128),
            CanonicalKVCacheTensor(strided[:, :96], 96),
            CanonicalKVCacheTensor(ssm, 48),
        ],
        group_data_refs=[
            [CanonicalKVCacheRef(0, 128), CanonicalKVCacheRef(1, 96)],
            [CanonicalKVCacheRef(0, 76), CanonicalKVCacheRef(2, 40)],
        ],
    )


def plane_offset(group: int, plane: int) -> int:
    """Where a plane's pages start in its group's row: planes in ref order, each start
    rounded up to 16 bytes, ``BPC`` pages per plane."""
    offset = 0
    for earlier in range(plane):
        offset = round_up(offset + BPC * PLANES[(group, earlier)][1], 16)
    return round_up(offset, 16)


def source_seed(rank: int, replicated: bool) -> int:
    # Replicated (MLA) pages are the same on every rank, but the non-writers here hold
    # other bytes: a rank that copied when it should not have would show in the region.
    return 100 if replicated and rank == 0 else 200 + rank


def poison(slot: int) -> int:
    return 0xA0 + slot


def _worker_body(
    rank: int, world_size: int, replicated: bool, engine_id: str, barrier: Any, spec_name: str
) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = make_config(rank, world_size, replicated, engine_id, spec_name)
    spec = getattr(tv, spec_name)(config)
    spec.region_barrier = barrier.wait  # the tiering spec's region takes none (as vLLM's)
    tensors = make_tensors(source_seed(rank, replicated))
    worker = spec.get_worker(canonical(tensors))
    region = worker.region
    paths = [region.mmap_path] + ([worker.ledger.region.mmap_path] if worker.ledger else [])
    stride = row_stride(world_size, replicated)
    raw = region.base_tensor.view(torch.uint8).view(NUM_CHUNKS, stride)
    slot = 0 if replicated else rank
    if not replicated or rank == 0:
        raw[:, slot * CPU_PAGE : (slot + 1) * CPU_PAGE] = poison(slot)
    barrier.wait()
    # The creator unlinks right after the region's barrier; by now it certainly has
    # (the tiering spec's region, shared with the scheduler, stays linked until the
    # creator's shutdown, as vLLM's does).
    linked_after_start = [os.path.exists(path) for path in paths]

    gpu = GPULoadStoreSpec(STORE_BLOCKS, group_sizes=GROUP_SIZES, block_indices=BLOCK_INDICES)
    if replicated and rank == 0:
        # The writer comes late: the other ranks must not report the store before it.
        time.sleep(0.2)
    assert worker.submit_store(7, gpu, CPULoadStoreSpec(CHUNKS))
    worker.wait({7})
    stored = [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
    # What this rank's page holds the moment the store is reported.
    at_report = raw[:, slot * CPU_PAGE : (slot + 1) * CPU_PAGE].clone()
    barrier.wait()  # every rank's store is in the region
    region_bytes = raw.clone()

    for tensor in tensors:
        tensor[LOAD_BLOCKS] = POISON_GPU
    load_gpu = GPULoadStoreSpec(LOAD_BLOCKS, group_sizes=GROUP_SIZES, block_indices=BLOCK_INDICES)
    assert worker.submit_load(8, CPULoadStoreSpec(CHUNKS), load_gpu)
    worker.wait({8})
    loaded = [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()]
    barrier.wait()
    del raw, region
    worker.shutdown()
    return {
        "num_chunks": spec.num_chunks,
        "stored": stored,
        "loaded": loaded,
        # numpy, not tensors: torch would share tensors through file descriptors that
        # vanish with this process.
        "region": region_bytes.numpy(),
        "at_report": at_report.numpy(),
        "caches": [tensor.numpy() for tensor in tensors],
        "linked_after_start": linked_after_start,
    }


def _worker_main(
    rank: int,
    world_size: int,
    replicated: bool,
    engine_id: str,
    barrier: Any,
    spec_name: str,
    conn: Any,
) -> None:
    try:
        body = _worker_body(rank, world_size, replicated, engine_id, barrier, spec_name)
        conn.send(("ok", body))
    except BaseException:
        # Release the other ranks from the barrier instead of leaving them to time out.
        barrier.abort()
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_workers(world_size: int, replicated: bool, spec_name: str) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(world_size, timeout=TIMEOUT_S)
    engine_id = f"shared-{uuid.uuid4()}"
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    processes = [
        context.Process(
            target=_worker_main,
            args=(rank, world_size, replicated, engine_id, barrier, spec_name, pipes[rank][1]),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes = []
    try:
        for rank, (receiver, _) in enumerate(pipes):
            assert receiver.poll(TIMEOUT_S), f"rank {rank} sent nothing in {TIMEOUT_S} s"
            outcomes.append(receiver.recv())
    finally:
        for process in processes:
            process.join(TIMEOUT_S)
            if process.is_alive():
                process.kill()
    errors = [f"rank {rank}:\n{body}" for rank, (kind, body) in enumerate(outcomes) if kind != "ok"]
    assert not errors, "\n".join(errors)
    assert all(process.exitcode == 0 for process in processes)
    assert not any(
        os.path.exists(f"/dev/shm/vllm_offload_{engine_id}{suffix}.mmap")
        for suffix in ("", "_triton_stores")
    )
    bodies = [body for _, body in outcomes]
    for body in bodies:
        body["region"] = torch.from_numpy(body["region"])
        body["at_report"] = torch.from_numpy(body["at_report"])
        body["caches"] = [torch.from_numpy(array) for array in body["caches"]]
    return bodies


def expected_region(world_size: int, replicated: bool) -> torch.Tensor:
    """The region after every rank's store, from the rules alone."""
    stride = row_stride(world_size, replicated)
    region = torch.zeros(NUM_CHUNKS, stride, dtype=torch.uint8)
    writers = [0] if replicated else list(range(world_size))
    for rank in writers:
        slot = 0 if replicated else rank
        region[:, slot * CPU_PAGE : (slot + 1) * CPU_PAGE] = poison(slot)
        tensors = make_tensors(source_seed(rank, replicated))
        for block, (group, chunk, block_slot) in zip(STORE_BLOCKS, PLACES, strict=True):
            for plane in range(2):
                tensor, size = PLANES[(group, plane)]
                start = slot * CPU_PAGE + plane_offset(group, plane) + block_slot * size
                region[chunk, start : start + size] = tensors[tensor][block, :size].view(
                    torch.uint8
                )
    return region


def expected_caches(rank: int, replicated: bool) -> list[torch.Tensor]:
    """A rank's caches after the load: its own (or rank 0's) stored pages in the load
    blocks, the poison elsewhere in those blocks, everything else as it was."""
    tensors = make_tensors(source_seed(rank, replicated))
    writer = make_tensors(source_seed(0 if replicated else rank, replicated))
    for tensor in tensors:
        tensor[LOAD_BLOCKS] = POISON_GPU
    for source, target, (group, _, _) in zip(STORE_BLOCKS, LOAD_BLOCKS, PLACES, strict=True):
        for plane in range(2):
            tensor, size = PLANES[(group, plane)]
            tensors[tensor][target, :size] = writer[tensor][source, :size]
    return tensors


def job_bytes() -> int:
    return 3 * (128 + 96) + 1 * (76 + 40)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("replicated", [False, True], ids=["per-worker", "replicated"])
@pytest.mark.parametrize("spec_name", ["TritonOffloadingSpec", "TritonTieringOffloadingSpec"])
def test_workers_share_one_region(world_size: int, replicated: bool, spec_name: str) -> None:
    results = run_workers(world_size, replicated, spec_name)
    region = expected_region(world_size, replicated)
    for rank, result in enumerate(results):
        assert result["num_chunks"] == NUM_CHUNKS
        writes = not replicated or rank == 0
        assert result["stored"] == [(7, True, job_bytes() if writes else 0)]
        assert result["loaded"] == [(8, True, job_bytes())]
        # One mapping: every rank saw the same bytes, and they are the expected ones.
        assert torch.equal(result["region"], region), f"rank {rank}"
        slot = 0 if replicated else rank
        page = slice(slot * CPU_PAGE, (slot + 1) * CPU_PAGE)
        assert torch.equal(result["at_report"], region[:, page]), f"rank {rank} reported early"
        for actual, expected in zip(
            result["caches"], expected_caches(rank, replicated), strict=True
        ):
            assert torch.equal(actual, expected), f"rank {rank}"
        # Unlinked once every worker had mapped it: nothing left behind by a crash.
        # (run_workers checks that nothing is left after every worker shut down.)
        tiering = spec_name == "TritonTieringOffloadingSpec"
        assert result["linked_after_start"] == [tiering] * len(result["linked_after_start"])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("replicated", [False, True], ids=["per-worker", "replicated"])
@pytest.mark.parametrize("verify", [False, True], ids=["unsealed", "sealed"])
def test_chunk_count_is_vllms_on_its_shared_region(
    world_size: int, replicated: bool, verify: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU spec on CUDA (its shared region): one copy per replicated chunk; with
    verification on, each worker page is 64 bytes longer (its seal), counted the same way."""
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    config = make_config(0, world_size, replicated, "count", tv.SPEC_NAME)
    extra = {"cpu_bytes_to_use": 1 << 20, "verify_chunks": verify}
    config = type(config)(**{**config.__dict__, "extra_config": extra})
    theirs = CPUOffloadingSpec(config)
    ours = tv.TritonOffloadingSpec(config)
    assert ours.replicated_layout is theirs.replicated_layout is replicated
    if not verify:
        assert (ours.num_chunks, ours.kv_bytes_per_chunk, ours.cpu_page_size_per_worker) == (
            theirs.num_chunks,
            theirs.kv_bytes_per_chunk,
            theirs.cpu_page_size_per_worker,
        )
    # By hand: 1 MiB over chunks of 672 (+ 64 sealed) bytes x copies, rounded up to 4 KiB.
    copies = 1 if replicated else world_size
    page = CPU_PAGE + (64 if verify else 0)
    assert ours.num_chunks == (1 << 20) // round_up(page * copies, PAGE)
    assert ours.cpu_page_size_per_worker == page


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("spec_name", ["TritonOffloadingSpec", "TritonTieringOffloadingSpec"])
def test_replicated_sizing_removes_the_world_factor(world_size: int, spec_name: str) -> None:
    """vLLM's own sizing case: one page per block, room for 8 single-copy chunks."""
    config = make_config(0, world_size, True, "sizing", spec_name)
    fields = {**config.__dict__, "worker_kv_bytes_per_block": PAGE}
    fields["extra_config"] = {"cpu_bytes_to_use": 8 * PAGE * BPC, "verify_chunks": False}
    spec = getattr(tv, spec_name)(type(config)(**fields))
    assert spec.replicated_layout is True
    assert spec.cpu_page_size_per_worker == spec.kv_bytes_per_chunk == PAGE * BPC
    assert spec.num_chunks == 8
    # Sealed: the page grows by its 64-byte seal and the row by a whole OS page.
    fields["extra_config"] = {"cpu_bytes_to_use": 8 * PAGE * BPC}
    sealed = getattr(tv, spec_name)(type(config)(**fields))
    assert sealed.cpu_page_size_per_worker == PAGE * BPC + 64
    assert sealed.kv_bytes_per_chunk == PAGE * BPC + PAGE
    assert sealed.num_chunks == 8 * PAGE * BPC // (PAGE * BPC + PAGE)
