"""vLLM's canonical pages as this project's fragment planes (``canonical_layout``).

Under vLLM's ``canonical_layout`` a host row holds each cache tensor's *canonical* page
(all KV heads, all tokens of the block, no parallelism) instead of each worker's own
pages. vLLM describes how a worker's page lands there with a ``CanonicalPageMapping`` per
``CanonicalKVCacheRef``: ``CopyRun``s of fragments ``[local_offset + i * local_stride,
+fragment_size)`` <-> ``[canonical_offset + i * canonical_stride, +fragment_size)``. Its
worker carves the row as ``create_next_canonical_view`` does: tensor ``t`` owns
``blocks_per_chunk * CP_t`` bytes starting at ``C_t = blocks_per_chunk * sum(CP of
earlier tensors)``, ``CP_t`` the largest canonical page among the refs of tensor ``t``;
slot ``s`` of chunk ``k`` starts at ``k * R + C_t + s * CP_t``.

Each fragment becomes one plane: base = the tensor's block 0 + local offset, block
stride = the tensor's, page = the fragment, pool offset = ``C_t`` + canonical offset,
slot stride = ``CP_t``, writers = the mapping's ``(num_writers, writer_index)``. The
engine's copy paths then write exactly the bytes vLLM's own descriptors write (the
differential test replays vLLM's descriptors as the judge). Nothing here imports vllm;
input errors are ValueError/TypeError naming the layer, before any byte moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from triton_offload.transfer.layout import CacheLayout, CacheSource, Plane
from triton_offload.vllm.convert import row_bytes_view


def _layer_name(group: int, position: int, layer_names: Sequence[Sequence[str]] | None) -> str:
    where = f"kv_caches.group_data_refs[{group}][{position}]"
    if layer_names is not None and group < len(layer_names):
        names = layer_names[group]
        if position < len(names):
            return f"layer {names[position]!r} ({where})"
    return where


def canonical_page_sizes(kv_caches: Any, layer_names: Sequence[Sequence[str]] | None) -> list[int]:
    """``CP_t`` of every tensor: the largest canonical page among its refs.

    ValueError naming the layer when a ref has no mapping (vLLM could not certify it:
    workers that are not exactly the TP x PCP grid, e.g. pipeline parallelism, or a
    packed cross-layer tensor) or when a tensor has no ref at all.
    """
    sizes = [0] * len(kv_caches.tensors)
    for group, refs in enumerate(kv_caches.group_data_refs):
        for position, ref in enumerate(refs):
            mapping = getattr(ref, "mapping", None)
            if mapping is None:
                raise ValueError(
                    f"{_layer_name(group, position, layer_names)} has no canonical mapping: "
                    "vLLM could not certify it for canonical_layout (offload workers must "
                    "be exactly the TP x PCP group, so no pipeline parallelism, and packed "
                    "cross-layer KV tensors are not supported); remove canonical_layout "
                    "from kv_connector_extra_config"
                )
            index = ref.tensor_idx
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"{_layer_name(group, position, layer_names)}: bad tensor_idx")
            if not 0 <= index < len(sizes):
                raise ValueError(
                    f"{_layer_name(group, position, layer_names)} tensor_idx {index} out of "
                    f"range [0, {len(sizes)})"
                )
            sizes[index] = max(sizes[index], int(mapping.canonical_page_size_bytes))
    for index, size in enumerate(sizes):
        if size < 1:
            raise ValueError(
                f"kv_caches.tensors[{index}] has no ref with a canonical page: vLLM's "
                "canonical layout gives every tensor a share of the row"
            )
    return sizes


def _ref_planes(
    ref: Any,
    view: torch.Tensor,
    *,
    group: int,
    position: int,
    pool_base: int,
    canonical_page: int,
    name: str,
) -> list[Plane]:
    """One plane per fragment of ``ref``'s mapping (checked against its pages)."""
    mapping = ref.mapping
    local_page = int(ref.page_size_bytes)
    if int(mapping.local_page_size_bytes) != local_page:
        raise ValueError(
            f"{name}: mapping.local_page_size_bytes {mapping.local_page_size_bytes} is not "
            f"the ref's page_size_bytes {local_page}"
        )
    if local_page > view.size(1):
        raise ValueError(
            f"{name}: page_size_bytes {local_page} exceeds the {view.size(1)} bytes per "
            "block of its tensor"
        )
    writers, writer_index = int(mapping.num_writers), int(mapping.writer_index)
    planes: list[Plane] = []
    for run in mapping.runs:
        size = int(run.fragment_size)
        for i in range(int(run.num_fragments)):
            local = int(run.local_offset) + i * int(run.local_stride)
            canonical = int(run.canonical_offset) + i * int(run.canonical_stride)
            if size < 1 or local < 0 or local + size > local_page:
                raise ValueError(
                    f"{name}: fragment [{local}, +{size}) lies outside the local page of "
                    f"{local_page} bytes"
                )
            if canonical < 0 or canonical + size > canonical_page:
                raise ValueError(
                    f"{name}: fragment at canonical offset {canonical} (+{size}) lies "
                    f"outside the canonical page of {canonical_page} bytes"
                )
            fragment = view[:, local : local + size]
            planes.append(
                Plane(
                    group=group,
                    base_address=fragment.data_ptr(),
                    block_stride=int(view.stride(0)),
                    page_bytes=size,
                    num_blocks=int(view.size(0)),
                    pool_offset=pool_base + canonical,
                    layer=position,
                    index=len(planes),
                    view=fragment,
                    slot_stride=canonical_page,
                    num_writers=writers,
                    writer_index=writer_index,
                )
            )
    return planes


def canonical_cache_layout(
    kv_caches: Any,
    blocks_per_chunk: int,
    *,
    layer_names: Sequence[Sequence[str]] | None = None,
) -> CacheLayout:
    """The engine's layout for vLLM's ``CanonicalKVCaches`` under ``canonical_layout``.

    ``layer_names[g]`` (the config's layer names of group ``g``, in ref order) only
    names layers in errors. The layout's ``row_bytes`` is the canonical area of a row,
    ``blocks_per_chunk * sum(CP_t)``; a caller checks it against vLLM's row stride.
    """
    sizes = canonical_page_sizes(kv_caches, layer_names)
    if not sizes:
        raise ValueError("kv_caches has no tensor: nothing to offload")
    views = [
        row_bytes_view(getattr(entry, "tensor", None), f"kv_caches.tensors[{index}]")
        for index, entry in enumerate(kv_caches.tensors)
    ]
    starts = [blocks_per_chunk * sum(sizes[:index]) for index in range(len(sizes))]
    planes: list[Plane] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        for position, ref in enumerate(refs):
            index = ref.tensor_idx
            planes += _ref_planes(
                ref,
                views[index],
                group=group,
                position=position,
                pool_base=starts[index],
                canonical_page=sizes[index],
                name=_layer_name(group, position, layer_names),
            )
    devices = {view.device for view in views}
    if len(devices) != 1:
        raise ValueError(f"kv_caches.tensors are on several devices: {sorted(map(str, devices))}")
    layout = CacheLayout.from_planes(
        planes,
        num_groups=len(kv_caches.group_data_refs),
        blocks_per_chunk=blocks_per_chunk,
        row_bytes=blocks_per_chunk * sum(sizes),
        device=views[0].device,
    )
    sources = tuple(
        CacheSource.of(entry.tensor, f"kv_caches.tensors[{index}]")
        for index, entry in enumerate(kv_caches.tensors)
    )
    return dataclasses.replace(layout, sources=sources)


__all__ = ["canonical_cache_layout", "canonical_page_sizes"]
