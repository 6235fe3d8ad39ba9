"""vLLM's secondary tiers under this backend: which are accepted, and the storage name tag.

vLLM's tiering spec puts fs, obj, p2p and KVCR tiers under the CPU tier. In its default
layout this backend's rows are its own, so a tier may only exchange chunks with
instances that write the same bytes: :func:`storage_layout_tag` names that layout, and
:func:`check_secondary_tiers` refuses tiers that cannot carry the name. Under vLLM's
``canonical_layout`` the rows are stock vLLM's canonical bytes: no tag, and the KVCR tier
is accepted (it shares chunks with stock instances, which write the same bytes).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from triton_offload.transfer.layout import ROW_LAYOUT_VERSION
from triton_offload.transfer.seal import digest8
from triton_offload.vllm.compat import logger

#: Where workers publish their plane arrangement for the scheduler (beside vLLM's region).
LAYOUT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
#: The tag's plane part when no worker of the engine published its planes (yet).
PLANES_UNPUBLISHED = "planes-unpublished"

#: Secondary tiers whose storage identity is vLLM's ``FileMapper`` fields (the fs folder,
#: the obj key prefix, the p2p peer fingerprint), which carry this spec's layout tag, or
#: that keep their chunks inside this process ("example").
TAGGED_TIERS = ("fs", "obj", "p2p", "example")
#: Secondary tiers refused outside ``canonical_layout``: their chunks are shared under
#: keys this spec cannot tag.
UNTAGGABLE_TIERS = ("kvcr",)


def storage_layout_tag(spec: Any) -> str:
    """The identity of the bytes this spec puts in a host chunk, for secondary tiers.

    vLLM's fs, obj and p2p tiers file a chunk under a digest of model, dtype, block and
    group fields, with no field for the byte layout inside the chunk; with their
    parallel-agnostic folders they also drop the parallel sizes when vLLM declares a
    block parallelism-invariant. This project's rows are neither vLLM's layout nor
    invariant across parallel layouts (each worker's page is plane-major over its own
    shard), so the tag names the row layout version, the per-worker page and chunk
    geometry, and the parallel sizes, except under ``replicated_layout`` where the one
    copy of a chunk is the same bytes whatever the TP size.
    """
    config = spec.config
    parts = [
        f"triton_offload-rows-v{ROW_LAYOUT_VERSION}",
        f"page{int(spec.cpu_page_size_per_worker)}",
        f"bpc{int(spec.blocks_per_chunk)}",
    ]
    if not spec.replicated_layout:
        parallel = config.parallel
        parts.append(
            f"tp{parallel.tp_size}-pp{parallel.pp_size}-pcp{parallel.pcp_size}"
            f"-dcp{parallel.dcp_size}"
        )
    kv_cache_layout = getattr(config, "kv_cache_layout", None)
    if kv_cache_layout:
        parts.append(f"kv-{kv_cache_layout}")
    return ":".join(parts)


def layout_note_path(engine_id: str, rank: int) -> str:
    """The file in which worker ``rank`` of ``engine_id`` publishes its plane arrangement."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))
    return os.path.join(LAYOUT_DIR, f"triton_offload_planes_{safe}_rank{int(rank)}.txt")


def publish_planes(engine_id: str, rank: int, description: str) -> str:
    """Write a worker's plane arrangement (atomically: a reader sees all of it or none)."""
    path = layout_note_path(engine_id, rank)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as handle:
        handle.write(description)
    os.replace(temporary, path)
    return path


def withdraw_planes(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


#: First line of a worker's planes note: its rows are stock vLLM's bytes, or its own.
STOCK_ROWS, OWN_ROWS = "rows=stock", "rows=own"


def stock_row_offsets(tensor_pages: list[int], blocks_per_chunk: int) -> list[int]:
    """Where vLLM's CPU worker puts each cache tensor in a worker page (its default,
    non-canonical layout): the tensors' chunk areas one after another, tensor ``t`` at
    the sum of ``page_bytes * blocks_per_chunk`` of the tensors before it."""
    offsets, offset = [], 0
    for page in tensor_pages:
        offsets.append(offset)
        offset += page * blocks_per_chunk
    return offsets


def rows_are_stock(
    tensor_pages: list[int],
    refs: list[tuple[int, int]],
    planes: list[tuple[int, int]],
    blocks_per_chunk: int,
) -> bool:
    """Whether this worker's rows are byte for byte what vLLM's CPU worker writes:
    ``refs`` are the ``(tensor index, page bytes)`` of every data ref in order (one per
    plane), ``planes`` the ``(pool offset, page bytes)`` of this project's planes. True
    only when every tensor has exactly one ref copying its whole page and each plane
    sits where vLLM puts its tensor (no alignment gap, no padding)."""
    if len(refs) != len(planes) or sorted(t for t, _ in refs) != list(range(len(tensor_pages))):
        return False
    stock = stock_row_offsets(tensor_pages, blocks_per_chunk)
    for (tensor, ref_page), (offset, page) in zip(refs, planes, strict=True):
        if ref_page != tensor_pages[tensor] or page != ref_page or offset != stock[tensor]:
            return False
    return True


def plane_notes(engine_id: str, world_size: int) -> list[str] | None:
    """Every worker's published plane note, by rank (None while some worker has not
    published: the scheduler runs before the workers only outside vLLM's engine, which
    registers the caches first)."""
    notes = []
    for rank in range(max(1, int(world_size))):
        try:
            with open(layout_note_path(engine_id, rank)) as handle:
                notes.append(handle.read())
        except FileNotFoundError:
            return None
    return notes


def notes_are_stock(notes: list[str]) -> bool:
    """Whether every worker's note says its rows are vLLM's CPU worker's bytes."""
    return all(note.split("\n", 1)[0].strip() == STOCK_ROWS for note in notes)


def planes_tag(notes: list[str] | None) -> str:
    """The tag's plane part: a digest of every worker's plane arrangement (two planes of
    K and V and one fused plane of the same bytes differ here), or
    :data:`PLANES_UNPUBLISHED` without every worker's note."""
    if notes is None:
        return PLANES_UNPUBLISHED
    return "planes-" + digest8("\n".join(notes)).hex()


def check_secondary_tiers(tiers: Any, spec_name: str, *, canonical: bool = False) -> None:
    """Refuse tiers whose chunks could be shared with another layout (ValueError).

    A tier outside :data:`TAGGED_TIERS` and :data:`UNTAGGABLE_TIERS` (an out-of-tree
    tier) is let through with a warning: it is kept apart only if it files chunks with
    vLLM's ``FileMapper.from_offloading_spec`` (which carries the layout tag). Under
    ``canonical`` (vLLM's ``canonical_layout``: the rows are stock vLLM's bytes) every
    tier vLLM's tiering spec takes is accepted, the KVCR tier included.
    """
    if not isinstance(tiers, list) or canonical:
        return  # vLLM's tiering spec raises its own error for a non-list
    for index, tier in enumerate(tiers):
        tier_type = tier.get("type") if isinstance(tier, Mapping) else None
        key = f"kv_connector_extra_config['secondary_tiers'][{index}]['type']"
        if tier_type in UNTAGGABLE_TIERS:
            raise ValueError(
                f"{key} {tier_type!r} is not supported by {spec_name} without "
                "canonical_layout: that tier shares chunks between instances keyed by "
                "block hash alone, with no field this spec can tag with its row layout, "
                "so it could hand back chunks written in vLLM's layout (or another "
                "geometry's) as this project's rows; set canonical_layout (the rows are "
                f"then vLLM's canonical bytes) or use one of {TAGGED_TIERS[:3]}"
            )
        if tier_type is not None and tier_type not in TAGGED_TIERS:
            logger.warning(
                "%s %r is an out-of-tree tier: %s keeps its chunks apart from other "
                "layouts only if the tier files them with vLLM's "
                "FileMapper.from_offloading_spec (its dtype field carries the layout "
                "tag); give it storage no other layout uses",
                key,
                tier_type,
                spec_name,
            )


__all__ = [
    "OWN_ROWS",
    "STOCK_ROWS",
    "TAGGED_TIERS",
    "UNTAGGABLE_TIERS",
    "check_secondary_tiers",
    "notes_are_stock",
    "plane_notes",
    "rows_are_stock",
    "stock_row_offsets",
    "storage_layout_tag",
]
