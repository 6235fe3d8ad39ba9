"""Device pointers back to block ids: vLLM 0.34's ``DevicePointers`` in this project's terms.

vLLM 0.34's connector worker resolves each job's GPU blocks to one pointer per (group,
ref, block) before any worker sees the job. The engine moves blocks by id, so a worker
given pointers derives the ids and checks every pointer against the caches it registered.
Pure numpy on duck-typed inputs (no vLLM import): the bench measures this path on hosts
without vLLM, and the vLLM worker uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GroupPlanes:
    """Where vLLM 0.34's pointer resolution puts one group's pages, one row per
    ``CanonicalKVCacheRef`` (int64 columns of shape ``(refs, 1)``, built once per worker so
    a job's check is pure array arithmetic): block ``b`` of ref ``r`` starts at
    ``bases[r] + b * strides[r]`` (bytes), is ``page_bytes[r]`` long, and ``b`` is below
    ``num_blocks[r]``."""

    bases: np.ndarray
    strides: np.ndarray
    page_bytes: np.ndarray
    num_blocks: np.ndarray

    @property
    def refs(self) -> int:
        return int(self.bases.shape[0])


def device_planes(kv_caches: Any) -> tuple[GroupPlanes, ...]:
    """Per group: the addresses vLLM 0.34's ``resolve_device_pointers`` computes its
    pointers from (each ref's tensor address, its block stride in bytes, the ref's
    unpadded page, the tensor's block count). Built once per worker."""
    tensors = list(kv_caches.tensors)
    groups = []
    for refs in kv_caches.group_data_refs:
        columns: list[list[int]] = [[], [], [], []]
        for ref in refs:
            tensor = tensors[int(ref.tensor_idx)].tensor
            row = (
                int(tensor.data_ptr()),
                int(tensor.stride(0)) * tensor.element_size(),
                int(ref.page_size_bytes),
                int(tensor.size(0)),
            )
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        groups.append(GroupPlanes(*(np.array(c, dtype=np.int64)[:, None] for c in columns)))
    return tuple(groups)


@dataclass(frozen=True)
class GPUBlocks:
    """GPU block ids of a job, ordered by group (the fields of vLLM's ``GPULoadStoreSpec``
    that :func:`split_job` reads)."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def blocks_from_pointers(device_ptrs: Any, planes: tuple[GroupPlanes, ...], what: str) -> GPUBlocks:
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
        if refs != group_planes.refs:
            raise ValueError(
                f"{what}: group {group} has {refs} refs in DevicePointers but "
                f"{group_planes.refs} in the offloaded caches"
            )
        if refs == 0:
            # A group with no layer on this worker (a pipeline stage): vLLM's pointers
            # carry no trace of its block ids, which the job's checks need.
            raise ValueError(
                f"{what}: group {group} has {count} blocks but no cache on this worker, so "
                "DevicePointers cannot name them; TritonOffloadingConnector passes block ids"
            )
        span = slice(offset, offset + count * refs)
        # Addresses are below 2**63 on every platform vLLM runs on.
        grid = ptrs[span].astype(np.int64).reshape(refs, count)
        pages = sizes[span].astype(np.int64).reshape(refs, count)
        offset += count * refs
        bases, strides = group_planes.bases, group_planes.strides
        page_bytes, limits = group_planes.page_bytes, group_planes.num_blocks
        ids = (grid[0] - bases[0, 0]) // strides[0, 0]
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


__all__ = ["GPUBlocks", "GroupPlanes", "blocks_from_pointers", "device_planes"]
