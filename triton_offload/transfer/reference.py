"""Plain torch reference of the block copy: the definition the kernel and CPU paths must match.

Deliberately simple: a loop over groups, pairs and planes with one slice copy each, on
uint8 views, so that it is obviously correct. It is slow (one tiny copy per page); fast
paths are tested byte-exactly against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout, byte_view

__all__ = ["byte_plane", "reference_copy"]


def byte_plane(tensor: torch.Tensor, page_bytes: int | None = None) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of a cache tensor whose dim 0 is the block dim.

    The per-block region (all dims after the first) must be contiguous; ``page_bytes``
    defaults to its full size and may be smaller (a prefix of each block). The view shares
    memory with ``tensor``: writes through it land in the cache.
    """
    if tensor.dim() < 1:
        raise ValueError("a cache plane needs a block dimension (dim 0)")
    element = tensor.element_size()
    inner = tensor[0] if tensor.shape[0] > 0 else tensor.new_empty(tensor.shape[1:])
    if not inner.is_contiguous():
        raise ValueError(
            f"per-block region of shape {tuple(tensor.shape[1:])} with strides "
            f"{tensor.stride()[1:]} is not contiguous"
        )
    region = inner.numel() * element
    if page_bytes is None:
        page_bytes = region
    if not 0 < page_bytes <= region:
        raise ValueError(f"page_bytes {page_bytes} does not fit a block region of {region} bytes")
    return byte_view(tensor, tensor.stride(0) * element, page_bytes)


def reference_copy(
    plane_views: Sequence[torch.Tensor],
    layout: CacheLayout,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    pool: torch.Tensor,
    direction: Direction | int,
) -> None:
    """Copy like the kernel does, one page at a time.

    ``plane_views[i]`` is the uint8 ``[num_blocks, page_bytes]`` view of
    ``layout.planes[i]``; ``pool`` is a uint8 ``[rows, >= layout.row_bytes]`` tensor
    (its rows may be spaced wider: row ``r`` is ``pool[r]`` whatever the stride);
    ``pairs`` / ``group_offsets`` as in :func:`triton_offload.transfer.jobs.validate_pairs` (not
    re-checked here).
    """
    direction = Direction(direction)
    if len(plane_views) != len(layout.planes):
        raise ValueError(f"{len(plane_views)} plane views for {len(layout.planes)} planes")
    for index, (view, plane) in enumerate(zip(plane_views, layout.planes, strict=True)):
        if view.dtype != torch.uint8 or tuple(view.shape) != (plane.num_blocks, plane.page_bytes):
            raise ValueError(
                f"plane view {index} is {view.dtype} {tuple(view.shape)}, expected uint8 "
                f"({plane.num_blocks}, {plane.page_bytes})"
            )
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.size(1) < layout.row_bytes:
        raise ValueError(
            f"pool must be uint8 [rows, >= {layout.row_bytes}], got {pool.dtype} "
            f"{tuple(pool.shape)}"
        )
    table = pairs.tolist()
    offsets = [int(x) for x in group_offsets.tolist()]
    for group in range(layout.num_groups):
        planes = [i for i, p in enumerate(layout.planes) if p.group == group]
        for gpu_block, row, slot in table[offsets[group] : offsets[group + 1]]:
            for i in planes:
                plane = layout.planes[i]
                page = row * layout.blocks_per_chunk + slot
                skipped = page % plane.num_writers != plane.writer_index
                if direction == Direction.TO_POOL and skipped:
                    continue  # another rank writes this slot
                start = plane.pool_offset + slot * plane.pool_slot_stride
                pool_page = pool[row, start : start + plane.page_bytes]
                cache_page = plane_views[i][gpu_block]
                if direction == Direction.TO_POOL:
                    pool_page.copy_(cache_page)
                else:
                    cache_page.copy_(pool_page)
