"""The chunk seal: a 64-byte record at the end of each page that says what the page holds.

A host chunk leaves the process (vLLM's secondary tiers copy whole rows to files,
objects and peers) and comes back as bytes nobody vouches for: a file cut short, a
same-size file of garbage, another chunk's valid file under this chunk's name, a row of
another layout. The seal travels inside the page, so every tier carries it, and it is
checked before the page's bytes count as loaded:

====== ===== ==========================================================================
offset bytes field
====== ===== ==========================================================================
0      8     magic ``TOSEAL`` + version (:data:`SEAL_MAGIC`)
8      8     config digest: what the scheduler also knows (storage name fields: model,
             dtype, page and chunk geometry, parallel sizes)
16     8     layout digest: the worker's row layout (plane offsets and page bytes per
             group, row layout version); only a worker can compute it
24     8     key digest: the chunk's offload key (zero when stored without one)
32     4     payload length: bytes of the page the store wrote and the checksum covers
36     4     payload CRC-32 (``zlib.crc32``)
40     2     page index (this worker's page of the row) and 2: page count
44     16    zero
60     4     CRC-32 of bytes 0-59 (a damaged seal is told apart from a wrong payload)
====== ===== ==========================================================================

CRC-32 because it is in the standard library on every machine this runs on (the GPU
machines' images included) and releases the GIL on large buffers; it detects every
burst error up to 32 bits and any single flipped byte, which is what a torn write or a
flipped bit in host memory leaves. It is not a defence against an adversary who
writes the shared directory: such a writer can forge any checksum.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from triton_offload.transfer.layout import ROW_LAYOUT_VERSION, Plane

#: Bytes of the seal at the end of every sealed page.
SEAL_BYTES = 64
#: First 8 bytes of every seal: the name and the seal format version.
SEAL_MAGIC = b"TOSEAL\x00\x01"
#: Key digest of a chunk stored without its offload key.
NO_KEY = bytes(8)

#: Threads that compute a job's page CRCs together (zlib releases the GIL on large
#: buffers, so pages are checksummed in parallel); CRC-32 runs at about 2-3 GB/s per
#: core (bench/suites/bench_seal.py), so a job's pages on 8 cores keep up with a
#: PCIe copy where one core is several times slower.
SEAL_THREADS = max(1, min(8, os.cpu_count() or 1))
#: Below this many payload bytes in a job, one thread (a pool hand-off costs more).
PARALLEL_MIN_BYTES = 1 << 20

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")

_FIELDS = struct.Struct("<8s8s8s8sIIHH16s")
_SEAL_CRC = struct.Struct("<I")
assert _FIELDS.size + _SEAL_CRC.size == SEAL_BYTES


def digest8(data: bytes | str) -> bytes:
    """An 8-byte BLAKE2b digest (formats and keys: collisions, not adversaries)."""
    if isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=8).digest()


def key_digest(key: bytes | None) -> bytes:
    """The seal's digest of an offload key (:data:`NO_KEY` for None)."""
    return NO_KEY if key is None else digest8(bytes(key))


@dataclasses.dataclass(frozen=True)
class SealFormat:
    """What a page's seal must say besides its key: the two format digests and the page's
    place in its row (``page_index`` of ``page_count`` pages)."""

    config_digest: bytes
    layout_digest: bytes
    page_index: int
    page_count: int

    def __post_init__(self) -> None:
        for name in ("config_digest", "layout_digest"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 8:
                raise ValueError(f"SealFormat.{name} must be 8 bytes, got {value!r}")
        if not 0 <= self.page_index < self.page_count <= 0xFFFF:
            raise ValueError(
                f"SealFormat page {self.page_index} of {self.page_count} is not a page "
                "index in [0, page_count) with page_count <= 65535"
            )


@dataclasses.dataclass(frozen=True)
class Seal:
    """A parsed seal (what :func:`read_seal` found in a page)."""

    config_digest: bytes
    layout_digest: bytes
    key_digest: bytes
    payload_bytes: int
    payload_crc: int
    page_index: int
    page_count: int


def _check_page(page: np.ndarray) -> None:
    if not isinstance(page, np.ndarray) or page.dtype != np.uint8 or page.ndim != 1:
        raise TypeError("a sealed page must be a 1-D uint8 numpy array")
    if page.size <= SEAL_BYTES:
        raise ValueError(f"a page of {page.size} bytes has no room for a {SEAL_BYTES}-byte seal")


def write_seal(page: np.ndarray, payload_bytes: int, fmt: SealFormat, key: bytes) -> None:
    """Seal ``page`` (its first ``payload_bytes`` bytes are the chunk's bytes)."""
    _check_page(page)
    if not 0 <= payload_bytes <= page.size - SEAL_BYTES:
        raise ValueError(
            f"payload_bytes {payload_bytes} does not fit before the seal of a {page.size}-byte page"
        )
    fields = _FIELDS.pack(
        SEAL_MAGIC,
        fmt.config_digest,
        fmt.layout_digest,
        key,
        payload_bytes,
        zlib.crc32(page[:payload_bytes]),
        fmt.page_index,
        fmt.page_count,
        bytes(16),
    )
    record = fields + _SEAL_CRC.pack(zlib.crc32(fields))
    page[page.size - SEAL_BYTES :] = np.frombuffer(record, dtype=np.uint8)


def read_seal(page: np.ndarray) -> Seal | str:
    """The page's seal, or why it has none (no magic, a damaged record)."""
    _check_page(page)
    record = page[page.size - SEAL_BYTES :].tobytes()
    if not any(record):
        return "no seal (the record is all zero bytes: never stored, or a short file)"
    fields = record[: _FIELDS.size]
    (magic, config, layout, key, length, crc, index, count, _) = _FIELDS.unpack(fields)
    if magic != SEAL_MAGIC:
        return f"no seal (magic {magic!r}, expected {SEAL_MAGIC!r})"
    if _SEAL_CRC.unpack(record[_FIELDS.size :])[0] != zlib.crc32(fields):
        return "damaged seal (its own CRC does not match)"
    return Seal(config, layout, key, length, crc, index, count)


def seal_problem(
    page: np.ndarray,
    fmt: SealFormat,
    key: bytes | None,
    *,
    check_layout: bool = True,
    expected_payload: int | None = None,
) -> str | None:
    """Why ``page`` may not be loaded as the chunk of ``key`` in format ``fmt``, or None.

    ``key`` None skips the key check (a job given without keys). ``check_layout`` False
    checks the config digest only (the scheduler, which cannot know the worker's
    layout, checks a promoted page that way; the worker checks both before loading).
    ``expected_payload``: the payload length this format writes, when known.
    """
    seal = read_seal(page)
    if isinstance(seal, str):
        return seal
    if seal.config_digest != fmt.config_digest:
        return "another configuration's chunk (config digest differs)"
    if check_layout and seal.layout_digest != fmt.layout_digest:
        return "another row layout's chunk (layout digest differs)"
    if (seal.page_index, seal.page_count) != (fmt.page_index, fmt.page_count):
        return (
            f"page {seal.page_index} of {seal.page_count} where page "
            f"{fmt.page_index} of {fmt.page_count} belongs"
        )
    if key is not None and seal.key_digest != key:
        return "another key's chunk (key digest differs)"
    if expected_payload is not None and seal.payload_bytes != expected_payload:
        return f"payload of {seal.payload_bytes} bytes, this format writes {expected_payload}"
    if seal.payload_bytes > page.size - SEAL_BYTES:
        return f"payload of {seal.payload_bytes} bytes does not fit in the page"
    if zlib.crc32(page[: seal.payload_bytes]) != seal.payload_crc:
        return "payload checksum mismatch (the chunk's bytes changed after it was sealed)"
    return None


class PageSealer:
    """Seals and checks the pages of one worker's part of a pool.

    ``pages``: uint8 ``[num_chunks, page_bytes]`` (rows may be strided: a worker's pages
    of a shared region); ``group_payload[g]``: the bytes a row of group ``g`` uses (the
    store writes them, the checksum covers them); the seal takes the last
    :data:`SEAL_BYTES` of each page.
    """

    def __init__(self, pages: np.ndarray, fmt: SealFormat, group_payload: Sequence[int]) -> None:
        if not isinstance(pages, np.ndarray) or pages.dtype != np.uint8 or pages.ndim != 2:
            raise TypeError("pages must be a 2-D uint8 numpy array [num_chunks, page_bytes]")
        if pages.shape[1] > 1 and pages.strides[1] != 1:
            raise ValueError("the bytes of a page must be contiguous")
        room = pages.shape[1] - SEAL_BYTES
        for group, payload in enumerate(group_payload):
            if not 0 <= payload <= room:
                raise ValueError(
                    f"group {group}'s {payload}-byte row does not fit before the seal of a "
                    f"{pages.shape[1]}-byte page"
                )
        self.pages = pages
        self.format = fmt
        self.group_payload = tuple(int(p) for p in group_payload)

    def close(self) -> None:
        """Drop the view of the pool: the pool's owner cannot unmap memory a view still
        exports (vLLM's region then stays mapped: "Keeping ... mapped")."""
        self.pages = np.empty((0, self.pages.shape[1]), np.uint8)

    def seal(self, chunk: int, group: int, key: bytes) -> None:
        write_seal(self.pages[chunk], self.group_payload[group], self.format, key)

    def problem(self, chunk: int, group: int, key: bytes | None) -> str | None:
        return seal_problem(
            self.pages[chunk], self.format, key, expected_payload=self.group_payload[group]
        )

    def seal_all(self, entries: Sequence[tuple[int, int, bytes]]) -> None:
        """Seal every ``(chunk, group, key)`` of a job (pages in parallel when large)."""
        _map(lambda entry: self.seal(*entry), entries, self._job_bytes(entries))

    def problems(self, entries: Sequence[tuple[int, int, bytes | None]]) -> list[str | None]:
        """Each ``(chunk, group, key)``'s problem or None, in order (in parallel)."""
        return _map(lambda entry: self.problem(*entry), entries, self._job_bytes(entries))

    def _job_bytes(self, entries: Sequence[tuple[int, int, object]]) -> int:
        return sum(self.group_payload[group] for _, group, _ in entries)


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _map(
    function: Callable[[_Item], _Result], items: Sequence[_Item], job_bytes: int
) -> list[_Result]:
    """``function`` over ``items`` in order, on the seal threads when the job is large."""
    if SEAL_THREADS == 1 or len(items) < 2 or job_bytes < PARALLEL_MIN_BYTES:
        return [function(item) for item in items]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                SEAL_THREADS, thread_name_prefix="triton-offload-seal"
            )
    return list(_pool.map(function, items))


def layout_description(planes: Sequence[Plane], blocks_per_chunk: int) -> str:
    """The text a layout digest is taken of: every plane's group, pool offset and page
    bytes in order, the chunk's block count and :data:`ROW_LAYOUT_VERSION` (two K/V
    planes and one fused plane of the same bytes differ here)."""
    parts = [f"rows-v{ROW_LAYOUT_VERSION}", f"bpc{blocks_per_chunk}"]
    parts += [f"g{p.group}@{p.pool_offset}x{p.page_bytes}" for p in planes]
    return ";".join(parts)


__all__ = [
    "NO_KEY",
    "SEAL_BYTES",
    "SEAL_MAGIC",
    "PageSealer",
    "Seal",
    "SealFormat",
    "digest8",
    "key_digest",
    "layout_description",
    "read_seal",
    "seal_problem",
    "write_seal",
]
