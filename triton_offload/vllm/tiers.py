"""vLLM's secondary tiers under this backend: which are accepted, and the storage name tag.

vLLM's tiering spec puts fs, obj, p2p and KVCR tiers under the CPU tier. In its default
layout this backend's rows are its own, so a tier may only exchange chunks with
instances that write the same bytes: :func:`storage_layout_tag` names that layout, and
:func:`check_secondary_tiers` refuses tiers that cannot carry the name. Under vLLM's
``canonical_layout`` the rows are stock vLLM's canonical bytes: no tag, and the KVCR tier
is accepted (it shares chunks with stock instances, which write the same bytes).

An fs tier's root is the engine user's alone (:func:`ensure_private_fs_roots`): vLLM's
fs tier creates its folders 0755 and its chunk files 0644 under the process umask, and
a chunk's KV gives away its prompt, so the root is where other local users are kept
out (created 0700 when absent; refused, naming it, when group or others may enter it).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
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


def _root_key(index: int) -> str:
    return f"kv_connector_extra_config['secondary_tiers'][{index}]['root_dir']"


def ensure_private_fs_roots(tiers: Any) -> None:
    """Make every fs tier's ``root_dir`` a folder only this process's user can enter, or
    refuse it (ValueError naming the key, the folder and what is wrong) before vLLM's
    tier writes anything into it.

    Why the root: vLLM's fs tier (``vllm/v1/kv_offload/tiering/fs/io.py`` and
    ``manager.py``) creates its folders with ``os.makedirs`` (0777 less the umask) and
    its chunk files with mode 0644, and offers no setting for either; everything it
    writes lies below ``root_dir``. A root of mode 0700 owned by the engine's user keeps
    every other local user from listing, reading or writing any of it whatever the
    modes below. So an absent root is created 0700 (its missing parents as vLLM would
    create them), and an existing one is refused when it is not a folder, belongs to
    another user (who reads every chunk) or grants group or others any permission (mode
    bits 0o077: read lists the chunks, write replaces them, search alone reaches the
    files vLLM makes readable to all, whose names follow from a guessed prompt).

    Entries of other types, and an ``fs`` entry whose ``root_dir`` is not a string, are
    left to vLLM's own checks.
    """
    if not isinstance(tiers, list):
        return
    for index, tier in enumerate(tiers):
        if not isinstance(tier, Mapping) or tier.get("type") != "fs":
            continue
        root = tier.get("root_dir")
        if isinstance(root, str):
            _ensure_private_folder(root, _root_key(index))


def _ensure_private_folder(root: str, key: str) -> None:
    if not root:
        raise ValueError(f"{key} is empty: vLLM's fs tier would write into /; name a folder")
    if not os.path.lexists(root):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
            # Another process of the engine may create it meanwhile: checked below.
            with contextlib.suppress(FileExistsError):
                os.mkdir(root, 0o700)  # the umask only takes bits away
        except OSError as error:
            reason = error.strerror or str(error)
            raise ValueError(f"{key} {root!r}: cannot create it ({reason})") from None
    try:
        status = os.stat(root)
    except OSError as error:
        raise ValueError(f"{key} {root!r}: cannot read it ({error.strerror or error})") from None
    if not stat.S_ISDIR(status.st_mode):
        raise ValueError(f"{key} {root!r} is not a folder")
    user = os.geteuid()
    if status.st_uid != user:
        raise ValueError(
            f"{key} {root!r} belongs to uid {status.st_uid}, not to this engine's user (uid "
            f"{user}): its owner can read every chunk (and so learn the prompts) and replace "
            "it; give the engine a folder of its own, mode 0700"
        )
    mode = stat.S_IMODE(status.st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{key} {root!r} has mode 0o{mode:o}: other local users may enter it, and vLLM's "
            "fs tier writes its chunk files readable by all (their KV gives away the "
            f"prompts; a writer can replace them); make it private: chmod 700 {root}"
        )


def check_secondary_tiers(tiers: Any, spec_name: str, *, canonical: bool = False) -> None:
    """Refuse tiers whose chunks could be shared with another layout (ValueError), and fs
    roots other local users could enter (:func:`ensure_private_fs_roots`, every layout).

    A tier outside :data:`TAGGED_TIERS` and :data:`UNTAGGABLE_TIERS` (an out-of-tree
    tier) is let through with a warning: it is kept apart only if it files chunks with
    vLLM's ``FileMapper.from_offloading_spec`` (which carries the layout tag). Under
    ``canonical`` (vLLM's ``canonical_layout``: the rows are stock vLLM's bytes) every
    tier vLLM's tiering spec takes is accepted, the KVCR tier included.
    """
    ensure_private_fs_roots(tiers)
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
    "ensure_private_fs_roots",
    "notes_are_stock",
    "plane_notes",
    "rows_are_stock",
    "stock_row_offsets",
    "storage_layout_tag",
]
