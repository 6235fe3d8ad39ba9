"""Cache tensors -> byte planes, and the host pool row layout.

Every cache tensor handed to the engine is seen as one *plane* of raw bytes:
``(base address, block stride, page bytes)``. A layer given as a plain tensor is one
plane; a layer given as a tuple of tensors (the K and V views of a ``(2, num_blocks,
...)`` tensor, the conv and SSM states of a Mamba layer) is one plane per tensor.

The pool row layout is plane-major (see the kernel contract): inside the row of
group ``g``, plane ``p`` of ``g`` owns ``blocks_per_chunk`` consecutive pages starting
at ``pool_offset_p``; slot ``s`` of that plane sits at ``pool_offset_p + s *
page_bytes_p``. Every plane start is rounded up to 16 bytes so that a plane whose
pages are 16-byte multiples keeps 16-byte aligned pages in the pool (the kernels use
16-byte accesses only where both sides allow them).

This module imports no Triton: the geometry is converted to the kernel's
``PlaneGeometry`` only on request (:meth:`Plane.geometry`). ``TransferEngine`` asks
for it on every backend, so that the launcher's checks validate every job alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from triton_offload.kernels.copy_blocks import PlaneGeometry

#: A layer of a cache group: one tensor (one plane) or a tuple of tensors (several planes).
Layer = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]

#: Byte alignment of every plane start and of the row length in the pool.
POOL_ALIGNMENT = 16


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Plane:
    """One contiguous-per-block byte region of a cache tensor.

    ``group``/``layer``/``index`` say where the plane came from (``index`` is the
    position inside a tuple layer, 0 for a plain tensor). Addresses and sizes are in
    bytes. ``view`` is a uint8 ``[num_blocks, page_bytes]`` strided view of the same
    memory (row ``b`` = the page of block ``b``), used by the CPU path and by tests.
    """

    group: int
    layer: int
    index: int
    base_address: int
    block_stride: int
    page_bytes: int
    num_blocks: int
    pool_offset: int
    view: torch.Tensor

    @property
    def name(self) -> str:
        return f"group {self.group} layer {self.layer} plane {self.index}"

    def geometry(self) -> PlaneGeometry:
        """The kernel's static description of this plane (imports the kernels)."""
        from triton_offload.kernels.copy_blocks import PlaneGeometry

        return PlaneGeometry(
            group=self.group,
            base_address=self.base_address,
            block_stride=self.block_stride,
            page_bytes=self.page_bytes,
            num_blocks=self.num_blocks,
            pool_offset=self.pool_offset,
        )


@dataclass(frozen=True)
class CacheLayout:
    """All planes of all groups, ordered by group, plus the pool row geometry.

    ``group_row_bytes[g]`` is the number of bytes a row of group ``g`` uses;
    ``row_bytes`` (the pool row length) is their maximum rounded up to 16.
    ``bytes_per_block[g]`` is the number of bytes one GPU block of group ``g`` moves
    (the sum of the page bytes of g's planes).
    """

    planes: tuple[Plane, ...]
    num_groups: int
    blocks_per_chunk: int
    group_num_blocks: tuple[int, ...]
    group_planes: tuple[tuple[int, ...], ...]
    group_row_bytes: tuple[int, ...]
    bytes_per_block: tuple[int, ...]
    row_bytes: int
    device: torch.device

    def geometries(self) -> list[PlaneGeometry]:
        return [plane.geometry() for plane in self.planes]


def _plane_tensors(layer: Any, group: int, layer_index: int) -> list[torch.Tensor]:
    if isinstance(layer, torch.Tensor):
        return [layer]
    if isinstance(layer, (tuple, list)) and layer:
        for index, tensor in enumerate(layer):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"group {group} layer {layer_index} plane {index}: expected a tensor, "
                    f"got {type(tensor).__name__}"
                )
        return list(layer)
    raise TypeError(
        f"group {group} layer {layer_index}: expected a tensor or a non-empty tuple of "
        f"tensors, got {layer!r:.80}"
    )


def _page_bytes(tensor: torch.Tensor, name: str) -> int:
    """Bytes of one block of ``tensor``; ValueError unless that region is contiguous."""
    if tensor.dim() < 1:
        raise ValueError(f"{name}: a 0-d tensor has no block dimension")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(f"{name}: layout {tensor.layout} is not a strided tensor")
    expected = 1
    for dim in range(tensor.dim() - 1, 0, -1):
        size = tensor.size(dim)
        if size != 1 and tensor.stride(dim) != expected:
            raise ValueError(
                f"{name}: the bytes of one block are not contiguous (shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}); each block's region "
                "must be contiguous, only the block dimension may be strided"
            )
        expected *= size
    page_bytes = expected * tensor.element_size()
    if page_bytes == 0:
        raise ValueError(f"{name}: a block holds 0 bytes (shape {tuple(tensor.shape)})")
    return page_bytes


def byte_view(tensor: torch.Tensor, block_stride: int, page_bytes: int) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of ``tensor``'s storage, any dtype.

    Row ``b`` starts ``b * block_stride`` bytes after ``tensor``'s first element; writes
    through the view land in the tensor. The caller checked that the page is contiguous.
    """
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    raw.set_(tensor.untyped_storage())
    return raw.as_strided(
        (tensor.size(0), page_bytes),
        (block_stride, 1),
        tensor.storage_offset() * tensor.element_size(),
    )


def build_layout(
    caches: Sequence[Sequence[Layer]],
    *,
    num_groups: int,
    blocks_per_chunk: int,
) -> CacheLayout:
    """Turn ``caches[g][layer]`` into planes and the plane-major pool row layout.

    Raises ValueError naming the group/layer for a wrong number of groups, a group
    without layers, a plane whose per-block bytes are not contiguous, overlapping
    blocks, planes of one group with different block counts, or tensors on
    different devices.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise TypeError(f"caches must be a sequence (one entry per group), got {type(caches)}")
    if len(caches) != num_groups:
        raise ValueError(f"caches has {len(caches)} groups but the plan has {num_groups} groups")
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk {blocks_per_chunk} must be >= 1")
    planes: list[Plane] = []
    group_num_blocks: list[int] = []
    group_planes: list[tuple[int, ...]] = []
    group_row_bytes: list[int] = []
    bytes_per_block: list[int] = []
    device: torch.device | None = None
    first_name = ""
    for group, layers in enumerate(caches):
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise TypeError(
                f"caches[{group}] must be a sequence of layers, got {type(layers).__name__}"
            )
        if len(layers) == 0:
            raise ValueError(f"group {group} has no layers")
        num_blocks: int | None = None
        offset = 0
        indices: list[int] = []
        group_bytes = 0
        for layer_index, layer in enumerate(layers):
            for index, tensor in enumerate(_plane_tensors(layer, group, layer_index)):
                name = f"group {group} layer {layer_index} plane {index}"
                if device is None:
                    device, first_name = tensor.device, name
                elif tensor.device != device:
                    raise ValueError(
                        f"{name} is on {tensor.device} but {first_name} is on {device}; "
                        "all cache tensors must be on one device"
                    )
                page_bytes = _page_bytes(tensor, name)
                blocks = tensor.size(0)
                if num_blocks is None:
                    num_blocks = blocks
                elif blocks != num_blocks:
                    raise ValueError(
                        f"{name} has {blocks} blocks but group {group} layer 0 has "
                        f"{num_blocks}; all caches of one group need the same block count"
                    )
                block_stride = tensor.stride(0) * tensor.element_size()
                if blocks > 1 and block_stride < page_bytes:
                    raise ValueError(
                        f"{name}: block stride {block_stride} bytes is smaller than the "
                        f"{page_bytes} bytes of a block; blocks would overlap"
                    )
                offset = _round_up(offset, POOL_ALIGNMENT)
                indices.append(len(planes))
                planes.append(
                    Plane(
                        group=group,
                        layer=layer_index,
                        index=index,
                        base_address=tensor.data_ptr(),
                        block_stride=block_stride,
                        page_bytes=page_bytes,
                        num_blocks=blocks,
                        pool_offset=offset,
                        view=byte_view(tensor, block_stride, page_bytes),
                    )
                )
                offset += blocks_per_chunk * page_bytes
                group_bytes += page_bytes
        assert num_blocks is not None
        group_num_blocks.append(num_blocks)
        group_planes.append(tuple(indices))
        group_row_bytes.append(offset)
        bytes_per_block.append(group_bytes)
    assert device is not None
    row_bytes = _round_up(max(group_row_bytes), POOL_ALIGNMENT)
    return CacheLayout(
        planes=tuple(planes),
        num_groups=num_groups,
        blocks_per_chunk=blocks_per_chunk,
        group_num_blocks=tuple(group_num_blocks),
        group_planes=tuple(group_planes),
        group_row_bytes=tuple(group_row_bytes),
        bytes_per_block=tuple(bytes_per_block),
        row_bytes=row_bytes,
        device=device,
    )


def pool_plane_view(pool: torch.Tensor, plane: Plane, blocks_per_chunk: int) -> torch.Tensor:
    """uint8 ``[pool_rows, blocks_per_chunk, page_bytes]`` view of ``plane``'s pool pages."""
    assert pool.dtype == torch.uint8 and pool.dim() == 2 and pool.stride(1) == 1
    return pool.as_strided(
        (pool.size(0), blocks_per_chunk, plane.page_bytes),
        (pool.stride(0), plane.page_bytes, 1),
        pool.storage_offset() + plane.pool_offset,
    )


__all__ = [
    "POOL_ALIGNMENT",
    "CacheLayout",
    "Layer",
    "Plane",
    "build_layout",
    "byte_view",
    "pool_plane_view",
]
