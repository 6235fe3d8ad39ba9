"""vLLM's objects in this project's terms: the plan, the cache planes, the jobs.

Pure conversions, no vllm import: vLLM's ``OffloadingConfig`` -> ``OffloadPlan``;
``CanonicalKVCaches`` -> the engine's per-group byte planes; a ``GPULoadStoreSpec`` (or
vLLM 0.34's ``DevicePointers``) / ``CPULoadStoreSpec`` pair -> a ``JobSpec``. Bad input
raises a ValueError or TypeError naming the field before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from triton_offload.planner.groups import GroupKind, GroupSpec, ParallelSpec
from triton_offload.planner.plan import OffloadPlan, plan_offload
from triton_offload.transfer.jobs import JobSpec


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


@dataclass(frozen=True)
class DevicePlane:
    """Where vLLM 0.34's pointer resolution puts one ref's pages: block ``b`` of the ref
    starts at ``base + b * stride`` (bytes) and is ``page_bytes`` long."""

    base: int
    stride: int
    page_bytes: int
    num_blocks: int


def device_planes(kv_caches: Any) -> tuple[tuple[DevicePlane, ...], ...]:
    """Per group, per ``CanonicalKVCacheRef``: the addresses vLLM 0.34's
    ``resolve_device_pointers`` computes its pointers from (the ref's tensor's address,
    its block stride, the ref's unpadded page). Built once per worker."""
    tensors = list(kv_caches.tensors)
    groups = []
    for refs in kv_caches.group_data_refs:
        planes = []
        for ref in refs:
            tensor = tensors[int(ref.tensor_idx)].tensor
            planes.append(
                DevicePlane(
                    base=int(tensor.data_ptr()),
                    stride=int(tensor.stride(0)) * tensor.element_size(),
                    page_bytes=int(ref.page_size_bytes),
                    num_blocks=int(tensor.size(0)),
                )
            )
        groups.append(tuple(planes))
    return tuple(groups)


@dataclass(frozen=True)
class GPUBlocks:
    """GPU block ids of a job, ordered by group (the fields of vLLM's ``GPULoadStoreSpec``
    that :func:`split_job` reads)."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def blocks_from_pointers(
    device_ptrs: Any, planes: tuple[tuple[DevicePlane, ...], ...], what: str
) -> GPUBlocks:
    """The GPU block ids behind vLLM 0.34's ``DevicePointers``, every pointer checked.

    vLLM orders ``ptrs`` by group, then ref, then block. Group ``g``'s ids come from its
    first ref (``(ptr - base) / stride``); every pointer of every ref must then be
    exactly ``base_r + id * stride_r`` of that ref and every size its page: a pointer
    into another tensor, between blocks or past the cache is refused (ValueError naming
    the group, ref, position and pointer) before any byte moves. Vectorized: O(1) numpy
    calls per group.
    """
    for field in ("ptrs", "sizes", "group_block_counts", "group_data_ref_counts"):
        if not hasattr(device_ptrs, field):
            raise TypeError(
                f"{what}: expected vLLM's DevicePointers or GPULoadStoreSpec, got "
                f"{type(device_ptrs).__name__} (no {field!r})"
            )
    counts = [int(c) for c in device_ptrs.group_block_counts]
    ref_counts = [int(c) for c in device_ptrs.group_data_ref_counts]
    indices = [int(i) for i in device_ptrs.block_indices]
    if not len(counts) == len(ref_counts) == len(indices) == len(planes):
        raise ValueError(
            f"{what}: DevicePointers has {len(counts)} group block counts, {len(ref_counts)} "
            f"ref counts and {len(indices)} block indices, but the offloaded caches have "
            f"{len(planes)} groups"
        )
    ptrs = np.asarray(device_ptrs.ptrs)
    sizes = np.asarray(device_ptrs.sizes)
    if ptrs.dtype != np.uint64 or sizes.dtype != np.uint64 or ptrs.ndim != 1:
        raise TypeError(
            f"{what}: DevicePointers.ptrs and .sizes must be 1-D uint64 arrays, got "
            f"{ptrs.dtype} {ptrs.shape} and {sizes.dtype} {sizes.shape}"
        )
    expected = sum(c * r for c, r in zip(counts, ref_counts, strict=True) if c)
    if ptrs.size != expected or sizes.shape != ptrs.shape:
        raise ValueError(
            f"{what}: DevicePointers has {ptrs.size} pointers and {sizes.size} sizes; its "
            f"group block counts {counts} x ref counts {ref_counts} need {expected}"
        )
    pieces: list[np.ndarray] = []
    offset = 0
    for group, (count, refs, group_planes) in enumerate(
        zip(counts, ref_counts, planes, strict=True)
    ):
        if count == 0:
            continue  # vLLM's resolution writes no pointer for an empty group
        if refs != len(group_planes):
            raise ValueError(
                f"{what}: group {group} has {refs} refs in DevicePointers but "
                f"{len(group_planes)} in the offloaded caches"
            )
        span = slice(offset, offset + count * refs)
        # Addresses are below 2**63 on every platform vLLM runs on.
        grid = ptrs[span].astype(np.int64).reshape(refs, count)
        pages = sizes[span].astype(np.int64).reshape(refs, count)
        offset += count * refs
        first = group_planes[0]
        ids = (grid[0] - first.base) // first.stride
        bases = np.array([p.base for p in group_planes], dtype=np.int64)[:, None]
        strides = np.array([p.stride for p in group_planes], dtype=np.int64)[:, None]
        page_bytes = np.array([p.page_bytes for p in group_planes], dtype=np.int64)[:, None]
        limits = np.array([p.num_blocks for p in group_planes], dtype=np.int64)[:, None]
        bad = (grid != bases + ids * strides) | (ids < 0) | (ids >= limits)
        if bad.any():
            ref, position = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(
                f"{what}: pointer {int(grid[ref, position]):#x} of group {group}, ref {ref}, "
                f"block {position} is not a block of that ref's cache (base "
                f"{int(bases[ref, 0]):#x}, stride {int(strides[ref, 0])} bytes, "
                f"{int(limits[ref, 0])} blocks)"
            )
        if (pages != page_bytes).any():
            ref, position = (int(v) for v in np.argwhere(pages != page_bytes)[0])
            raise ValueError(
                f"{what}: size {int(pages[ref, position])} of group {group}, ref {ref}, block "
                f"{position} is not the ref's {int(page_bytes[ref, 0])}-byte page"
            )
        pieces.append(ids)
    block_ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return GPUBlocks(block_ids, tuple(counts), tuple(indices))


def split_job(
    gpu_spec: Any, host_spec: Any, num_groups: int, blocks_per_chunk: int, what: str
) -> JobSpec:
    """The ``JobSpec`` (per group: GPU block ids, host chunk ids, first index) of a vLLM job.

    vLLM orders both specs by group: group ``g`` has ``group_sizes[g]`` GPU blocks,
    the first at logical block ``block_indices[g]`` of its request, and, when
    non-empty, ``ceil((block_indices[g] % bpc + group_sizes[g]) / bpc)`` host chunks
    (the first chunk's leading ``block_indices[g] % bpc`` slots are skipped).
    """
    sizes = [int(size) for size in gpu_spec.group_sizes]
    starts = [int(index) for index in gpu_spec.block_indices]
    if len(sizes) != num_groups or len(starts) != num_groups:
        raise ValueError(
            f"{what}: GPULoadStoreSpec has {len(sizes)} group sizes and {len(starts)} block "
            f"indices, but the offloaded caches have {num_groups} groups"
        )
    gpu_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64).reshape(-1)
    host_ids = np.asarray(host_spec.block_ids, dtype=np.int64).reshape(-1)
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
    "DevicePlane",
    "GPUBlocks",
    "blocks_from_pointers",
    "caches_from_canonical",
    "device_planes",
    "plan_from_offloading_config",
    "row_bytes_view",
    "split_job",
]
