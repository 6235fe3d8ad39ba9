"""vLLM's worker transfer test, rewritten for TritonOffloadingSpec on vLLM's shared region.

vLLM checks its CPU worker with random GPU blocks mapped to random CPU chunks, a first
chunk entered in the middle, three host-memory variants (a private buffer, a shared
region where the worker is one of two, a single-copy replicated region) and a
three-group job with an empty group and an unaligned one. The same checks run here
against this project's spec, built by vLLM's factory from an ``OffloadingConfig``:
the worker's region is vLLM's ``SharedOffloadRegion``, and the expected host bytes are
computed from the row-layout rule (worker page ``slot`` of chunk ``c`` at
``c * row_stride + slot * cpu_page_size``; inside it, plane ``p`` of the chunk's group
at ``p * round_up(blocks_per_chunk * page, 16)``, block slot ``s`` ``s * page`` further),
not from the engine's own tables. Every byte of the region and of the GPU tensors is
compared: addressed pages equal their source, everything else unchanged.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
import torch

from tests.helpers.vllm_fixtures import offloading_config, round_up

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingGroupConfig
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    VLLM_ERROR: str | None = None
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    VLLM_ERROR = f"vllm cannot be imported: {error}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

PAGE = 4096
NUM_GPU_BLOCKS = 64
NUM_CPU_CHUNKS = 16
NUM_MAPPINGS = 3

# (world size, this worker's rank, replicated layout): the worker alone in its region,
# the second of two workers (the first worker's pages must stay untouched), and one of
# two ranks sharing a single copy (rank 0, the writer).
VARIANTS = {
    "private": (1, 0, False),
    "shared": (2, 1, False),
    "replicated": (2, 0, True),
}


def make_config(
    *,
    num_groups: int,
    worker_bytes: int,
    blocks_per_chunk: int,
    world_size: int,
    rank: int,
    replicated: bool,
    num_chunks: int,
) -> OffloadingConfig:
    copies = 1 if replicated else world_size
    chunk_bytes = round_up(worker_bytes * copies * blocks_per_chunk, PAGE)
    return offloading_config(
        groups=[
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layer.{g}",), group_id=g)
            for g in range(num_groups)
        ],
        worker_bytes=worker_bytes,
        blocks_per_chunk=blocks_per_chunk,
        extra_config={
            "spec_name": "TritonOffloadingSpec",
            "spec_module_path": "triton_offload.vllm",
            "cpu_bytes_to_use": num_chunks * chunk_bytes,
            "verify_chunks": False,  # the copy is judged here; seals in test_integrity.py
            "backend": "torch",
        },
        engine_id=f"transfer-{uuid.uuid4()}",
        rank=rank,
        world_size=world_size,
        replicated=replicated,
        max_model_len=4096,
    )


class Setup:
    """A worker of the spec over ``groups x tensors_per_group`` GPU tensors."""

    def __init__(
        self,
        variant: str,
        *,
        num_groups: int,
        tensors_per_group: int,
        page: int,
        blocks_per_chunk: int,
    ) -> None:
        world_size, rank, replicated = VARIANTS[variant]
        # A page that is no multiple of 16 sits in a padded block (as vLLM pads Mamba
        # pages): the worker's share of a chunk then has room for 16-byte plane starts.
        stride = round_up(page, 16)
        self.page = page
        self.bpc = blocks_per_chunk
        self.tensors_per_group = tensors_per_group
        num_tensors = num_groups * tensors_per_group
        self.gpu = [
            torch.zeros(NUM_GPU_BLOCKS, stride, dtype=torch.int8) for _ in range(num_tensors)
        ]
        canonical = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, stride) for t in self.gpu],
            group_data_refs=[
                [
                    CanonicalKVCacheRef(g * tensors_per_group + i, page)
                    for i in range(tensors_per_group)
                ]
                for g in range(num_groups)
            ],
        )
        config = make_config(
            num_groups=num_groups,
            worker_bytes=num_tensors * stride,
            blocks_per_chunk=blocks_per_chunk,
            world_size=world_size,
            rank=rank,
            replicated=replicated,
            num_chunks=NUM_CPU_CHUNKS,
        )
        self.spec = OffloadingSpecFactory.create_spec(config)
        assert self.spec.num_chunks == NUM_CPU_CHUNKS
        self.worker = self.spec.get_worker(canonical)
        self.slot = 0 if replicated else rank
        self.cpu_page = num_tensors * stride * blocks_per_chunk
        self.row_stride = round_up(self.cpu_page * (1 if replicated else world_size), PAGE)
        region = self.worker.region
        assert region.total_size_bytes == NUM_CPU_CHUNKS * self.row_stride
        self.raw = region.base_tensor.view(torch.uint8).view(NUM_CPU_CHUNKS, self.row_stride)

    def host_page(self, chunk: int, plane: int, slot: int) -> slice:
        """Bytes of row ``chunk`` holding block slot ``slot`` of the group's plane ``plane``."""
        start = self.slot * self.cpu_page + plane * round_up(self.bpc * self.page, 16)
        start += slot * self.page
        return slice(start, start + self.page)

    def finish(self, job_id: int, expected_bytes: int) -> None:
        started = time.monotonic()
        deadline = started + 10
        while time.monotonic() < deadline:
            finished = self.worker.get_finished()
            if finished:
                (result,) = finished
                assert (result.job_id, result.success) == (job_id, True)
                assert result.transfer_size == expected_bytes
                assert result.transfer_time is not None
                assert 0 <= result.transfer_time < time.monotonic() - started + 1
                return
            time.sleep(0.01)
        raise AssertionError(f"job {job_id} did not finish")

    def close(self) -> None:
        del self.raw
        self.worker.shutdown()


def _expand(chunks: list[int], bpc: int) -> list[tuple[int, int]]:
    return [(chunk, slot) for chunk in chunks for slot in range(bpc)]


def _run(
    setup: Setup,
    store: bool,
    per_group: list[tuple[list[int], list[tuple[int, int]], int]],
) -> None:
    """One job: per group (GPU blocks, (chunk, slot) of each, first block index)."""
    tensors = setup.tensors_per_group
    gpu_ids = [b for blocks, _, _ in per_group for b in blocks]
    sizes = [len(blocks) for blocks, _, _ in per_group]
    starts = [first for _, _, first in per_group]
    chunk_ids: list[int] = []
    for _, places, _ in per_group:
        group_chunks: list[int] = []
        for chunk, _ in places:
            if chunk not in group_chunks:
                group_chunks.append(chunk)
        chunk_ids += group_chunks
    gpu_spec = GPULoadStoreSpec(gpu_ids, group_sizes=sizes, block_indices=starts)
    cpu_spec = CPULoadStoreSpec(chunk_ids)

    generator = torch.Generator().manual_seed(7)
    for tensor in setup.gpu:
        tensor.copy_(torch.randint(-128, 128, tensor.shape, dtype=torch.int8, generator=generator))
    setup.raw.copy_(torch.randint(0, 256, setup.raw.shape, dtype=torch.uint8, generator=generator))
    gpu_before = [t.clone() for t in setup.gpu]
    raw_before = setup.raw.clone()
    gpu_expected = [t.clone() for t in setup.gpu]
    raw_expected = setup.raw.clone()
    for group, (blocks, places, _) in enumerate(per_group):
        for block, (chunk, slot) in zip(blocks, places, strict=True):
            for plane in range(tensors):
                tensor = group * tensors + plane
                host = setup.host_page(chunk, plane, slot)
                page = slice(0, setup.page)
                if store:
                    raw_expected[chunk, host] = gpu_before[tensor][block, page].view(torch.uint8)
                else:
                    gpu_expected[tensor][block, page] = raw_before[chunk, host].view(torch.int8)

    job_bytes = sum(sizes) * tensors * setup.page
    if store:
        assert setup.worker.submit_store(1, gpu_spec, cpu_spec)
    else:
        assert setup.worker.submit_load(1, cpu_spec, gpu_spec)
    setup.finish(1, job_bytes)
    for actual, expected in zip(setup.gpu, gpu_expected, strict=True):
        assert torch.equal(actual, expected)
    assert torch.equal(setup.raw, raw_expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("page", [512, 200])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_transfer(variant: str, blocks_per_chunk: int, page: int, store: bool) -> None:
    """Random blocks to random chunks, the first chunk entered after bpc - 1 slots."""
    rng = random.Random(0)
    setup = Setup(
        variant, num_groups=1, tensors_per_group=4, page=page, blocks_per_chunk=blocks_per_chunk
    )
    try:
        blocks = rng.sample(range(NUM_GPU_BLOCKS), NUM_MAPPINGS * blocks_per_chunk)
        chunks = rng.sample(range(NUM_CPU_CHUNKS), NUM_MAPPINGS)
        places = _expand(chunks, blocks_per_chunk)
        skip = blocks_per_chunk - 1
        _run(setup, store, [(blocks[skip:], places[skip:], skip)])
    finally:
        setup.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_transfer_multi_group(variant: str, blocks_per_chunk: int, store: bool) -> None:
    """Group 0 aligned, group 1 empty, group 2 entering and leaving chunks mid-way."""
    rng = random.Random(1)
    setup = Setup(
        variant, num_groups=3, tensors_per_group=2, page=512, blocks_per_chunk=blocks_per_chunk
    )
    try:
        chunks = rng.sample(range(NUM_CPU_CHUNKS), 2 * 2)
        blocks = rng.sample(range(NUM_GPU_BLOCKS), 4 * blocks_per_chunk)
        places0 = _expand(chunks[:2], blocks_per_chunk)
        places2 = _expand(chunks[2:], blocks_per_chunk)
        blocks0 = blocks[: 2 * blocks_per_chunk]
        blocks2 = blocks[2 * blocks_per_chunk :]
        skip = blocks_per_chunk - 1
        if skip:
            blocks2, places2 = blocks2[skip:-skip], places2[skip:-skip]
        _run(setup, store, [(blocks0, places0, 0), ([], [], 0), (blocks2, places2, skip)])
    finally:
        setup.close()
