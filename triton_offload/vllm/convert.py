"""vLLM's objects in this project's terms: the plan, the cache planes, the jobs.

Pure conversions, no vllm import: vLLM's ``OffloadingConfig`` -> ``OffloadPlan``;
``CanonicalKVCaches`` -> the engine's per-group byte planes; a ``GPULoadStoreSpec`` (or
vLLM 0.34's ``DevicePointers``) / ``CPULoadStoreSpec`` pair -> a ``JobSpec``. Bad input
raises a ValueError or TypeError naming the field before any byte moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec
from triton_offload.planner.plan import OffloadPlan, plan_offload
from triton_offload.transfer.jobs import JobSpec, int64_ids
from triton_offload.transfer.layout import check_cache_tensor


def plan_from_offloading_config(config: Any) -> OffloadPlan:
    """This project's ``OffloadPlan`` for vLLM's ``OffloadingConfig``.

    vLLM's ``tokens_per_block`` already spans the DCP ranks where the group is
    DCP-sharded (attention) and not where it is replicated (Mamba), so each group is
    given with that span as its block size and ``dcp_sharded=False``: scaling it
    again would repeat the Mamba span bug. ``OffloadingConfig`` carries no cache
    kind, only each group's window in chunks, so a group without a window plans as
    full attention and a windowed one (sliding window, chunked local, Mamba: one
    chunk) as a sliding window of exactly that many chunks. The worker only needs
    the groups, spans and ``blocks_per_chunk`` from the plan; lookups stay vLLM's.
    """
    blocks_per_chunk = int(config.cache.blocks_per_chunk)
    specs = []
    for group in config.groups:
        tokens_per_block = int(group.tokens_per_block)
        name = f"vllm group {group.group_id}"
        window = group.sliding_window_size_in_chunks
        if window is None:
            specs.append(
                GroupSpec(GroupKind.FULL_ATTENTION, tokens_per_block, dcp_sharded=False, name=name)
            )
        else:
            specs.append(
                GroupSpec(
                    GroupKind.SLIDING_WINDOW,
                    tokens_per_block,
                    sliding_window=int(window) * tokens_per_block * blocks_per_chunk,
                    dcp_sharded=False,
                    name=name,
                )
            )
    parallel = ParallelSpec(
        tp_size=int(config.parallel.tp_size),
        dcp_size=int(config.parallel.dcp_size),
        pcp_size=int(config.parallel.pcp_size),
    )
    return plan_offload(specs, parallel, blocks_per_chunk=blocks_per_chunk)


def caches_from_canonical(kv_caches: Any) -> list[list[torch.Tensor]]:
    """``TransferEngine`` caches (per group, one uint8 plane per ref) from vLLM's caches.

    Each ``CanonicalKVCacheRef`` of group ``g`` becomes a uint8 ``[num_blocks,
    ref.page_size_bytes]`` view of its tensor: block stride from the tensor, page =
    the ref's unpadded page (a Mamba page padded to the attention page copies only
    its real bytes). Refs of different groups may point at one tensor (vLLM's hybrid
    allocator overlays them); block ids keep them apart.
    """
    tensors = list(kv_caches.tensors)
    views: list[torch.Tensor] = []
    for index, entry in enumerate(tensors):
        tensor = getattr(entry, "tensor", None)
        views.append(row_bytes_view(tensor, f"kv_caches.tensors[{index}]"))
    caches: list[list[torch.Tensor]] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        layers: list[torch.Tensor] = []
        for position, ref in enumerate(refs):
            name = f"kv_caches.group_data_refs[{group}][{position}]"
            index = ref.tensor_idx
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"{name}.tensor_idx must be an int, got {index!r}")
            if not 0 <= index < len(views):
                raise ValueError(
                    f"{name}.tensor_idx {index} out of range [0, {len(views)}) tensors"
                )
            row = views[index]
            page = ref.page_size_bytes
            if isinstance(page, bool) or not isinstance(page, int) or page < 1:
                raise ValueError(f"{name}.page_size_bytes must be a positive int, got {page!r}")
            if page > row.size(1):
                raise ValueError(
                    f"{name}.page_size_bytes {page} exceeds the {row.size(1)} bytes per block "
                    f"of kv_caches.tensors[{index}]"
                )
            layers.append(row[:, :page])
        caches.append(layers)
    return caches


def row_bytes_view(tensor: Any, name: str) -> torch.Tensor:
    """uint8 ``[num_blocks, bytes_per_block]`` view of a ``(num_blocks, ...)`` tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}.tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 2:
        raise ValueError(
            f"{name}.tensor has shape {tuple(tensor.shape)}; expected (num_blocks, ...)"
        )
    # Checked before the view below, so each is refused as what it is: a 0-block tensor
    # cannot be viewed as [0, -1], and a meta tensor has no device memory to copy.
    check_cache_tensor(tensor, f"{name}.tensor")
    try:
        rows = tensor.view(tensor.size(0), -1)
        if rows.size(1) > 1 and rows.stride(1) != 1:
            raise RuntimeError("per-block elements are strided")
        return rows.view(torch.uint8)
    except RuntimeError as error:
        raise ValueError(
            f"{name}.tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}): the "
            "bytes of one block must be contiguous, only the block dimension may be strided"
        ) from error


def split_job(
    gpu_spec: Any, host_spec: Any, num_groups: int, blocks_per_chunk: int, what: str
) -> JobSpec:
    """The ``JobSpec`` (per group: GPU block ids, host chunk ids, first index) of a vLLM job.

    vLLM orders both specs by group: group ``g`` has ``group_sizes[g]`` GPU blocks,
    the first at logical block ``block_indices[g]`` of its request, and, when
    non-empty, ``ceil((block_indices[g] % bpc + group_sizes[g]) / bpc)`` host chunks
    (the first chunk's leading ``block_indices[g] % bpc`` slots are skipped). Both
    specs' ``block_ids`` must be 1-d integer arrays (any width) or int lists: anything
    else is refused naming the spec, the value and its index (``int64_ids``).
    """
    sizes = [int(size) for size in gpu_spec.group_sizes]
    starts = [int(index) for index in gpu_spec.block_indices]
    if len(sizes) != num_groups or len(starts) != num_groups:
        raise ValueError(
            f"{what}: GPULoadStoreSpec has {len(sizes)} group sizes and {len(starts)} block "
            f"indices, but the offloaded caches have {num_groups} groups"
        )
    # Checked, not cast: ``np.asarray(ids, dtype=np.int64).reshape(-1)`` took 1.5 as block
    # 1, "5" as block 5, True as block 1, NaN as -2**63 (then reported as a negative id)
    # and flattened a 2-D array. vLLM's constructors cast to int32, but ``block_ids`` is
    # a plain attribute a caller (or a subclass) may set to anything.
    gpu_ids, _ = int64_ids(gpu_spec.block_ids, f"{what}: GPULoadStoreSpec block_ids")
    host_ids, _ = int64_ids(host_spec.block_ids, f"{what}: CPULoadStoreSpec block_ids")
    if sum(sizes) != gpu_ids.size:
        raise ValueError(
            f"{what}: group sizes {sizes} add up to {sum(sizes)} but the GPU spec has "
            f"{gpu_ids.size} block ids"
        )
    chunks = [
        0 if size == 0 else -(-((start % blocks_per_chunk) + size) // blocks_per_chunk)
        for size, start in zip(sizes, starts, strict=True)
    ]
    if sum(chunks) != host_ids.size:
        raise ValueError(
            f"{what}: the GPU spec (group sizes {sizes}, block indices {starts}, "
            f"blocks_per_chunk {blocks_per_chunk}) needs {sum(chunks)} CPU chunk ids "
            f"({chunks} per group), the CPU spec has {host_ids.size}"
        )
    gpu_bounds = np.cumsum([0, *sizes])
    host_bounds = np.cumsum([0, *chunks])
    gpu_blocks = [gpu_ids[gpu_bounds[g] : gpu_bounds[g + 1]] for g in range(num_groups)]
    host_blocks = [host_ids[host_bounds[g] : host_bounds[g + 1]] for g in range(num_groups)]
    return JobSpec(gpu_blocks, host_blocks, starts)


__all__ = [
    "caches_from_canonical",
    "plan_from_offloading_config",
    "row_bytes_view",
    "split_job",
]
