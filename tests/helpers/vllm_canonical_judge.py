"""vLLM's canonical layout as its own code writes it: the judge of canonical bytes.

Caches are registered with vLLM's own ``OffloadingConnectorWorker.register_kv_caches``
(so the ``CanonicalKVCaches`` and their ``CopyRun`` mappings come from vLLM's
``derive_canonical_mappings``), and vLLM's own descriptor code
(``SingleDirectionOffloadingHandler._fill_canonical_ops`` with its writer rotation, on
CPU tensors carved by ``SharedOffloadRegion.create_next_canonical_view``; from vLLM
0.34 on, fed GPU pointers from its ``resolve_device_pointers``) is replayed with
``ctypes.memmove``: vLLM's CUDA worker cannot run on CPU (it needs CUDA streams and
copy kernels), its descriptors can. Used by ``tests/vllm/test_canonical.py`` and by the
real-tier harness (``tier_peers.py``), whose stock vLLM instances write and read their
rows this way.
"""

from __future__ import annotations

import ctypes
import inspect
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from triton_offload.transfer.jobs import JobSpec

#: Defaults of tests/vllm/test_canonical.py: 12 GPU blocks, 3 blocks per chunk.
NUM_BLOCKS = 12
BPC = 3


@dataclass(frozen=True)
class Geometry:
    """One model/parallel geometry: ``kind`` names the cache layout of every layer."""

    name: str
    kind: str  # hnd, nhd, split_nhd, split_hnd, mla
    total_heads: int
    tp: int
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1
    groups: int = 1
    layers: int = 2
    block_size: int = 4
    head_size: int = 6  # bf16: 12-byte heads, odd fragment sizes for the copy paths

    @property
    def world(self) -> int:
        return self.tp * self.pcp


def _spec(geometry: Geometry) -> Any:
    heads = max(1, geometry.total_heads // geometry.tp)
    if geometry.kind == "mla":
        return MLAAttentionSpec(
            block_size=geometry.block_size,
            num_kv_heads=1,
            head_size=geometry.head_size,
            dtype=torch.bfloat16,
        )
    return FullAttentionSpec(
        block_size=geometry.block_size,
        num_kv_heads=heads,
        head_size=geometry.head_size,
        dtype=torch.bfloat16,
    )


def _layer_cache(
    geometry: Geometry, generator: torch.Generator, num_blocks: int = NUM_BLOCKS
) -> torch.Tensor:
    """One layer's cache in the geometry's physical layout, random bf16 bits."""
    n, bs, hs = num_blocks, geometry.block_size, geometry.head_size
    heads = max(1, geometry.total_heads // geometry.tp)
    shapes = {
        "hnd": ((n, heads, bs, 2 * hs), None),
        "nhd": ((n, bs, heads, 2 * hs), (0, 2, 1, 3)),
        "split_nhd": ((n, 2, bs, heads, hs), None),
        "split_hnd": ((n, 2, heads, bs, hs), (0, 1, 3, 2, 4)),
        "mla": ((n, bs, hs), None),
    }
    shape, permutation = shapes[geometry.kind]
    raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    tensor = raw.view(torch.bfloat16)
    return tensor.permute(*permutation) if permutation else tensor


def vllm_canonical_caches(
    geometry: Geometry, rank: int, seed: int, num_blocks: int = NUM_BLOCKS
) -> tuple[Any, list[Any]]:
    """Rank ``rank``'s caches as vLLM's connector registers them: (CanonicalKVCaches,
    the layer tensors that must stay alive)."""
    spec = _spec(geometry)
    groups = [
        KVCacheGroupSpec([f"g{g}.layer{i}" for i in range(geometry.layers)], spec)
        for g in range(geometry.groups)
    ]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    parallel = types.SimpleNamespace(
        tensor_parallel_size=geometry.tp,
        prefill_context_parallel_size=geometry.pcp,
        decode_context_parallel_size=geometry.dcp,
        cp_kv_cache_interleave_size=geometry.interleave,
        world_size=geometry.world,
        rank=rank,
    )
    vllm_config = types.SimpleNamespace(
        parallel_config=parallel,
        model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: geometry.total_heads),
    )
    captured: dict[str, Any] = {}

    class CapturingSpec:
        replicated_layout = False
        config = types.SimpleNamespace(
            canonical_layout=True, parallel=types.SimpleNamespace(rank=rank)
        )

        def get_worker(self, kv_caches: Any) -> None:
            captured["kv_caches"] = kv_caches

    generator = torch.Generator().manual_seed(seed)
    layers = {
        name: _layer_cache(geometry, generator, num_blocks)
        for group in groups
        for name in group.layer_names
    }
    OffloadingConnectorWorker(CapturingSpec(), vllm_config, config).register_kv_caches(layers)
    return captured["kv_caches"], list(layers.values())


def canonical_views(
    kv_caches: Any, pool: torch.Tensor, blocks_per_chunk: int = BPC
) -> list[torch.Tensor]:
    """vLLM's CPU tensors of its canonical layout, carved from ``pool`` by its own
    ``create_next_canonical_view`` (on a region object that maps nothing)."""
    region = object.__new__(SharedOffloadRegion)
    rows, stride = pool.size(0), pool.stride(0)
    region._base = pool.as_strided((rows * stride,), (1,)).view(torch.int8)
    region._row_stride = pool.stride(0)
    region._canonical_offset = 0
    region.num_chunks = pool.size(0)
    region._views = []
    sizes = gpu_worker._canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
    return [region.create_next_canonical_view(size * blocks_per_chunk) for size in sizes]


#: vLLM 0.34 resolves GPU blocks to pointers before its handler runs
#: (``resolve_device_pointers``) and ``_fill_canonical_ops`` takes those pointers plus
#: the CPU chunk ids; 0.33 took GPU and CPU block ids for both sides. Which one the
#: installed vLLM has decides how its descriptors are produced.
_FILL_TAKES_DEVICE_POINTERS = "device_ptrs" in (
    inspect.signature(gpu_worker.SingleDirectionOffloadingHandler._fill_canonical_ops).parameters
)


def vllm_replay(
    kv_caches: Any, pool: torch.Tensor, job: JobSpec, store: bool, blocks_per_chunk: int = BPC
) -> None:
    """Execute vLLM's own canonical descriptors for ``job`` with memmove.

    ``pool``: rows of the host region (row stride = ``pool.stride(0)``), the canonical
    area at the start of each row; ``job``: GPU blocks, host rows and first block index
    per group, as this project's engine takes them.
    """
    cpu = canonical_views(kv_caches, pool, blocks_per_chunk)
    fill = _device_pointer_ops if _FILL_TAKES_DEVICE_POINTERS else _block_id_ops
    src, dst, lengths = fill(kv_caches, cpu, job, store, blocks_per_chunk)
    for target, source, length in zip(dst, src, lengths, strict=True):
        ctypes.memmove(int(target), int(source), int(length))


def _descriptor_buffers(total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst, lengths = (np.zeros(total, dtype=np.int64) for _ in range(3))
    return src, dst, lengths


def _device_pointer_ops(
    kv_caches: Any, cpu: list[torch.Tensor], job: JobSpec, store: bool, blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM >= 0.34: the connector's ``resolve_device_pointers`` turns the GPU spec
    into pointers, and the handler (built by its own constructor, which no longer
    asserts CUDA tensors) fills descriptors group by group as its ``transfer_async``
    does, slicing the concatenated CPU chunk ids by ``iter_pointer_groups``."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups, resolve_device_pointers

    handler = gpu_worker.SingleDirectionOffloadingHandler(
        cpu_tensors=cpu,
        blocks_per_chunk=blocks_per_chunk,
        layer_refs_per_group=kv_caches.group_data_refs,
        gpu_to_cpu=store,
        canonical_layout=True,
        # Plain host memory: keeps the handler on the copy-engine path, which touches
        # no device at construction.
        host_memory_is_pinned=False,
    )
    gpu_spec = GPULoadStoreSpec(
        [int(block) for blocks in job.gpu_blocks for block in blocks],
        group_sizes=[blocks.size for blocks in job.gpu_blocks],
        block_indices=[int(first) for first in job.first_block_index],
    )
    device_ptrs = resolve_device_pointers(gpu_spec, kv_caches)
    cpu_blocks = np.concatenate([np.asarray(hosts, dtype=np.int64) for hosts in job.host_blocks])
    src, dst, lengths = _descriptor_buffers(
        handler._estimate_max_copy_ops(device_ptrs.group_block_counts)
    )
    op = cpu_offset = 0
    for group in iter_pointer_groups(device_ptrs, blocks_per_chunk):
        cpu_end = cpu_offset + group.n_chunks
        assert cpu_end <= cpu_blocks.size
        op, _ = handler._fill_canonical_ops(
            group.group_idx,
            device_ptrs=device_ptrs,
            dev_ptr_offset=group.dev_ptr_offset,
            cpu_block_ids=cpu_blocks[cpu_offset:cpu_end],
            group_size=group.group_size,
            cpu_skip_count=group.skip,
            all_src=src,
            all_dst=dst,
            all_sizes=lengths,
            op_idx=op,
        )
        cpu_offset = cpu_end
    assert cpu_offset == cpu_blocks.size
    return src[:op], dst[:op], lengths[:op]


def _block_id_ops(
    kv_caches: Any, cpu: list[torch.Tensor], job: JobSpec, store: bool, blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM 0.33: block ids on both sides, on a handler whose attributes are set
    by hand because its constructor asserts CUDA tensors."""
    handler = object.__new__(gpu_worker.SingleDirectionOffloadingHandler)
    gpu = [t.tensor.view(torch.int8).view((-1, t.page_size_bytes)) for t in kv_caches.tensors]
    handler.src_tensors, handler.dst_tensors = (gpu, cpu) if store else (cpu, gpu)
    handler.gpu_to_cpu = store
    handler.layer_refs_per_group = kv_caches.group_data_refs
    handler.src_blocks_per_chunk = 1 if store else blocks_per_chunk
    handler.dst_blocks_per_chunk = blocks_per_chunk if store else 1
    handler._canonical_copy_plans = [
        [gpu_worker._build_copy_plan(ref, store) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]
    handler._scratch_bases_src = np.empty(
        max(1, sum(b.size for b in job.gpu_blocks)), dtype=np.uint64
    )
    handler._scratch_bases_dst = np.empty(
        max(1, sum(b.size for b in job.gpu_blocks)), dtype=np.uint64
    )
    sizes = [blocks.size for blocks in job.gpu_blocks]
    src, dst, lengths = _descriptor_buffers(handler._estimate_max_copy_ops(sizes))
    op = 0
    for group, (blocks, hosts, first) in enumerate(
        zip(job.gpu_blocks, job.host_blocks, job.first_block_index, strict=True)
    ):
        if not blocks.size:
            continue
        group_src, group_dst = (blocks, hosts) if store else (hosts, blocks)
        op, _ = handler._fill_canonical_ops(
            group,
            group_src=group_src,
            group_dst=group_dst,
            group_size=blocks.size,
            src_skip_count=first % handler.src_blocks_per_chunk,
            dst_skip_count=first % handler.dst_blocks_per_chunk,
            all_src=src,
            all_dst=dst,
            all_sizes=lengths,
            op_idx=op,
        )
    return src[:op], dst[:op], lengths[:op]
