"""The chunk seal: a 64-byte record at the end of each page that says what the page holds.

A host chunk leaves the process (vLLM's secondary tiers copy whole rows to files,
objects and peers) and comes back as bytes nobody vouches for: a file cut short, a
same-size file of garbage, another chunk's valid file under this chunk's name, a row of
another layout. The seal travels inside the page, so every tier carries it, and it is
checked before the page's bytes count as loaded. Seal format v2 (little-endian):

====== ===== ==========================================================================
offset bytes field
====== ===== ==========================================================================
0      8     magic ``TOSEAL`` + format version 2 (:data:`SEAL_MAGIC`)
8      8     config digest: what the scheduler also knows (storage name fields: model,
             dtype, page and chunk geometry, parallel sizes)
16     8     layout digest: the worker's row layout (plane offsets and page bytes per
             group, row layout version); only a worker can compute it
24     8     key digest: XXH3-64 of the chunk's offload key (zero when stored without one)
32     8     payload checksum (u64): :func:`page_checksum` of the payload, by the
             algorithm at offset 48; in a keyed seal the tag over the page's identity
             and that keyed checksum (which is never stored)
40     4     payload length: bytes of the page the checksum covers (the group's row)
44     2     page index (this worker's page of the row) and 46 2: page count
48     1     checksum algorithm: 1 ``wsum64``, 2 ``xxh3_64``; keyed: 3
             ``keyed_wsum64``, 4 ``keyed_ghash64`` (:data:`ALGORITHMS`)
49     7     key id of the seal key (keyed seals, :mod:`~triton_offload.transfer.seal_key`);
             zero in unkeyed seals
56     8     header check: ``wsum64`` of bytes 0-55 (a damaged seal is told apart from
             a wrong payload)
====== ===== ==========================================================================

Two unkeyed algorithms (and their two keyed forms), each defined once in
:func:`page_checksum`, because the bytes flow through two kinds of machine. On CUDA (and
under the Triton interpreter) the copy kernel, or a device pass beside a DMA copy,
computes ``wsum64`` of the bytes while they are in registers: no extra PCIe or HBM
traffic and no host byte read. A weighted sum is what a kernel can build from per-tile
partial sums in any order; a host CPU without AVX-512 computes it at ~3.4 GB/s, slower
than the copy. On the CPU path the host
hashes the page itself with XXH3-64 (12-30 GB/s per core here, faster than the copy).
The seal names its algorithm, so every reader can check every page: a worker whose path
computes the other algorithm checks that page on the host (counted, logged), and the
scheduler checks headers only (no payload byte).

Neither is a defence against an adversary who writes the shared directory: such a
writer can forge any checksum. With a seal key the checksum field holds a keyed tag
instead (:mod:`triton_offload.transfer.seal_key`: a keyed universal hash computed where
the bytes move, finished by a PRF over the page's identity), and an engine with a key
refuses every page that is not sealed under it, unkeyed seals included. Format v1 (zlib
CRC-32, before the checksum moved into the copy) is refused with a reason naming the
version and counted (:func:`refused_formats`), never misread.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from triton_offload.transfer.layout import ROW_LAYOUT_VERSION, Plane
from triton_offload.transfer.seal_key import KEY_ID_BYTES, SealKey

#: Bytes of the seal at the end of every sealed page.
SEAL_BYTES = 64
#: First 8 bytes of every seal: the name and the seal format version.
SEAL_MAGIC = b"TOSEAL\x00\x02"
#: The name every seal format shares (its last two bytes are the version).
SEAL_NAME = SEAL_MAGIC[:6]
SEAL_VERSION = 2
#: Key digest of a chunk stored without its offload key.
NO_KEY = bytes(8)

#: The checksum algorithms a seal may name, with their ids in the seal.
ALGORITHMS: dict[str, int] = {"wsum64": 1, "xxh3_64": 2, "keyed_wsum64": 3, "keyed_ghash64": 4}
ALGORITHM_NAMES: dict[int, str] = {number: name for name, number in ALGORITHMS.items()}
#: What kernels and device passes compute (CUDA, the Triton interpreter).
DEVICE_ALGORITHM = "wsum64"
#: What the host computes where it copies the bytes itself (the CPU path).
HOST_ALGORITHM = "xxh3_64"
#: Their keyed forms (a seal key configured): the universal hashes a keyed tag is made of.
KEYED_DEVICE_ALGORITHM = "keyed_wsum64"
KEYED_HOST_ALGORITHM = "keyed_ghash64"
KEYED_ALGORITHMS = frozenset({KEYED_DEVICE_ALGORITHM, KEYED_HOST_ALGORITHM})


def checksum_algorithm(on_device: bool, keyed: bool) -> str:
    """What a copy computes per page: on a device (a kernel or device pass) or on the
    host (the CPU path), with or without a seal key."""
    if keyed:
        return KEYED_DEVICE_ALGORITHM if on_device else KEYED_HOST_ALGORITHM
    return DEVICE_ALGORITHM if on_device else HOST_ALGORITHM


#: The seal as numpy reads and writes it, a record per page (batched header work).
RECORD = np.dtype(
    [
        ("magic", "S8"),
        ("config", "S8"),
        ("layout", "S8"),
        ("key", "S8"),
        ("checksum", "<u8"),
        ("length", "<u4"),
        ("index", "<u2"),
        ("count", "<u2"),
        ("algorithm", "u1"),
        ("key_id", "S7"),
        ("check", "<u8"),
    ]
)
assert RECORD.itemsize == SEAL_BYTES
_CHECKED_BYTES = 56  # the header check covers the record up to itself

#: A page whose payload does not match its seal: damaged after sealing, or (keyed) forged
#: by a writer without the key.
PAYLOAD_MISMATCH = "payload checksum mismatch (the chunk's bytes changed after it was sealed)"

#: A keyed seal read without a key: not judged, refused (never misread as unkeyed).
KEYED_WITHOUT_KEY = "keyed seal, and this engine has no seal key to check it (seal_key_file)"

_refusals: collections.Counter[int] = collections.Counter()
_refusals_lock = threading.Lock()


def _count_refusal(version: int, pages: int = 1) -> None:
    with _refusals_lock:
        _refusals[version] += pages


def refused_formats() -> dict[int, int]:
    """Pages refused for an old seal format in this process, by format version."""
    with _refusals_lock:
        return dict(_refusals)


def digest8(data: bytes | str) -> bytes:
    """An 8-byte BLAKE2b digest (formats and keys: collisions, not adversaries)."""
    if isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=8).digest()


def key_digest(key: bytes | None, seal_key: SealKey | None = None) -> bytes:
    """The seal's digest of an offload key: its XXH3-64 (seed 0) as 8 big-endian bytes,
    :data:`NO_KEY` for None; with a seal key, the key's keyed chunk digest
    (:meth:`SealKey.chunk_digest`: XXH3 collisions can be searched offline). Computed
    once per chunk of every verified job: XXH3 costs a quarter of BLAKE2b's ~0.6 us per
    key (16% of an 8 KiB-page load's time, profiled), so unkeyed seals keep it."""
    if key is None:
        return NO_KEY
    return xxhash.xxh3_64_digest(key) if seal_key is None else seal_key.chunk_digest(key)


def key_digests(keys: Sequence[bytes], seal_key: SealKey | None = None) -> np.ndarray:
    """``[len(keys), 8]`` uint8: :func:`key_digest` of each key, in one pass."""
    if seal_key is not None:
        return seal_key.chunk_digests(keys)
    joined = b"".join(map(xxhash.xxh3_64_digest, keys))
    return np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), 8)


# ------------------------------------------------------------------------- checksums

_GOLDEN = 0x9E3779B1


@functools.lru_cache(maxsize=64)
def wsum64_weights(num_words: int) -> np.ndarray:
    """``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32`` for ``j < num_words``, as uint64."""
    j = np.arange(num_words, dtype=np.uint64)
    weights = ((2 * j + 1) * np.uint64(_GOLDEN)) & np.uint64(0xFFFF_FFFF)
    weights.flags.writeable = False
    return weights


def _payload_array(payload: object) -> np.ndarray:
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            raise TypeError(
                f"payload must be a 1-D uint8 array, got dtype {payload.dtype} with "
                f"{payload.ndim} dimensions"
            )
        return payload
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    raise TypeError(f"payload must be bytes or a 1-D uint8 array, got {type(payload).__name__}")


def _wsum64_rows(rows: np.ndarray) -> np.ndarray:
    """``wsum64`` of each row of a ``[n, L]`` uint8 array (zero-padded to whole words)."""
    count, length = rows.shape
    words = -(-length // 4)
    if length % 4:
        padded = np.zeros((count, words * 4), dtype=np.uint8)
        padded[:, :length] = rows
        rows = padded
    weights = wsum64_weights(words)
    if words < 1024:
        # Headers and small pages: one vectorized pass over all rows.
        values = np.ascontiguousarray(rows).view("<u4").astype(np.uint64)
        values *= weights
        return values.sum(axis=1, dtype=np.uint64)
    # Large pages: a dot product per row runs at ~4 GB/s here, twice the whole-array
    # multiply and sum (which makes an 8-byte copy of every word first).
    out = np.empty(count, dtype=np.uint64)
    for index in range(count):
        out[index] = np.dot(
            np.ascontiguousarray(rows[index]).view("<u4").astype(np.uint64), weights
        )
    return out


def page_checksum(
    payload: object, algorithm: str = HOST_ALGORITHM, seal_key: SealKey | None = None
) -> int:
    """The checksum a seal stores for ``payload`` (bytes or a 1-D uint8 array): the
    reference every path must equal, bit for bit.

    ``"wsum64"``: with ``w_j`` the little-endian 32-bit words of the payload (the last
    one zero-padded) and ``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32``,
    ``sum_j w_j * h(j) mod 2**64``. Every ``h(j)`` is odd, so any change of one word,
    hence every 1- and 2-bit error within a word, changes the sum, and so does a swap
    of two different words (``h`` differs between positions). It is linear: zero bytes
    add nothing, so a kernel sums only the bytes it moves (a row's never-written
    alignment gaps are zero) and per-tile partial sums add up in any order.

    ``"xxh3_64"``: XXH3 64-bit with seed 0 of the payload bytes (the host's algorithm:
    one pass at memory speed).

    The default is the host's algorithm, the one the CPU path seals with; kernels and
    device passes seal with ``wsum64`` (:data:`DEVICE_ALGORITHM`).

    ``"keyed_wsum64"`` and ``"keyed_ghash64"`` need ``seal_key``: its universal hashes
    (:class:`~triton_offload.transfer.seal_key.SealKey`), the part of a keyed tag that
    covers the payload.
    """
    data = _payload_array(payload)
    if algorithm in KEYED_ALGORITHMS:
        key = _needed_key(algorithm, seal_key)
        if algorithm == KEYED_HOST_ALGORITHM:
            return key.keyed_ghash64(np.ascontiguousarray(data))
        return key.keyed_wsum64(data)
    if algorithm == "xxh3_64":
        return int(xxhash.xxh3_64_intdigest(np.ascontiguousarray(data)))
    if algorithm == "wsum64":
        return int(_wsum64_rows(data.reshape(1, -1))[0]) if data.size else 0
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(ALGORITHMS)}")


def _needed_key(algorithm: str, seal_key: SealKey | None) -> SealKey:
    if seal_key is None:
        raise ValueError(f"checksum algorithm {algorithm!r} is keyed: it needs the seal key")
    return seal_key


def page_checksums(
    pages: np.ndarray,
    rows: np.ndarray,
    lengths: np.ndarray,
    algorithm: str,
    seal_key: SealKey | None = None,
) -> np.ndarray:
    """uint64 :func:`page_checksum` of ``pages[rows[i], :lengths[i]]`` for every ``i``
    (the host's batched form: one C call per page for XXH3 and GHASH, one numpy pass per
    distinct length for ``wsum64``)."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(rows.size, dtype=np.uint64)
    if algorithm in ("xxh3_64", KEYED_HOST_ALGORITHM):
        digest = (
            xxhash.xxh3_64_intdigest
            if algorithm == "xxh3_64"
            else _needed_key(algorithm, seal_key).keyed_ghash64
        )
        if rows.size and pages.ndim == 2 and (pages.shape[1] <= 1 or pages.strides[1] == 1):
            # One flat view of the rows' span: slicing a memoryview costs a fraction of
            # a numpy row view, which matters at 8 KiB pages (one call per page).
            stride = int(pages.strides[0]) if pages.shape[0] > 1 else int(pages.shape[1])
            span = (pages.shape[0] - 1) * stride + pages.shape[1]
            flat = memoryview(np.lib.stride_tricks.as_strided(pages, (span,), (1,)))
            starts = (rows * stride).tolist()
            out[:] = [
                digest(flat[start : start + length])
                for start, length in zip(starts, lengths.tolist(), strict=True)
            ]
        else:
            out[:] = [
                digest(pages[row, :length])
                for row, length in zip(rows.tolist(), lengths.tolist(), strict=True)
            ]
        return out
    if algorithm not in ("wsum64", KEYED_DEVICE_ALGORITHM):
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(ALGORITHMS)}")
    summed = (
        _wsum64_rows
        if algorithm == "wsum64"
        else _needed_key(algorithm, seal_key).keyed_wsum64_rows
    )
    for length in np.unique(lengths).tolist():
        where = np.flatnonzero(lengths == length)
        if length:
            out[where] = summed(pages[rows[where], :length])
    return out


# ------------------------------------------------------------------------------ seal


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
    payload_checksum: int
    algorithm: str
    page_index: int
    page_count: int
    #: The seal key's id (keyed seals), zero bytes in an unkeyed seal.
    key_id: bytes = bytes(KEY_ID_BYTES)


def _check_page(page: np.ndarray) -> None:
    if not isinstance(page, np.ndarray) or page.dtype != np.uint8 or page.ndim != 1:
        raise TypeError("a sealed page must be a 1-D uint8 numpy array")
    if page.size <= SEAL_BYTES:
        raise ValueError(f"a page of {page.size} bytes has no room for a {SEAL_BYTES}-byte seal")


def _check_algorithm(algorithm: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(ALGORITHMS)}")
    return ALGORITHMS[algorithm]


def _header_words_check(words: np.ndarray) -> np.ndarray:
    """The header check of seals given as ``[n, 8]`` u64 words (their first 7 words, as
    the 14 u32 words ``wsum64`` weighs)."""
    halves = np.ascontiguousarray(words[:, :7]).view("<u4").astype(np.uint64)
    halves *= wsum64_weights(14)
    return halves.sum(axis=1, dtype=np.uint64)


#: The header check's weights of u32 halves 6-9: a seal's words 3 and 4 (key digest and
#: checksum), the only words that differ between the pages of one group.
_PAGE_WORD_WEIGHTS = wsum64_weights(14)[6:10]


def header_checks(records: np.ndarray) -> np.ndarray:
    """The header check of each record (``wsum64`` of its first 56 bytes), uint64."""
    raw = records.view(np.uint8).reshape(-1, SEAL_BYTES)[:, :_CHECKED_BYTES]
    return _wsum64_rows(raw)


def _key_id_word(seal_key: SealKey) -> np.uint64:
    """Bytes 49-55 of a keyed seal as their share of the record's u64 word 6."""
    return np.uint64(int.from_bytes(seal_key.key_id, "little") << 8)


def _keyed_numbers() -> list[int]:
    return [ALGORITHMS[name] for name in sorted(KEYED_ALGORITHMS)]


def _stored_checksums(
    records: np.ndarray, values: np.ndarray, seal_key: SealKey | None
) -> np.ndarray:
    """What the checksum field of each record must hold when its payload's checksum by
    the record's algorithm is ``values[i]``: the value itself (unkeyed), the key's tag
    over the record's identity and the value (keyed; ``seal_key`` required then)."""
    keyed = np.flatnonzero(np.isin(records["algorithm"], _keyed_numbers()))
    if keyed.size == 0:
        return values
    assert seal_key is not None, "keyed records are refused by their header without a key"
    words = np.ascontiguousarray(records[keyed]).view("<u8").reshape(-1, 8)
    out = np.array(values, dtype=np.uint64, copy=True)
    out[keyed] = seal_key.tags(words, out[keyed])
    return out


def seal_records(
    count: int,
    fmt: SealFormat,
    keys: np.ndarray,
    checksums: np.ndarray,
    lengths: np.ndarray,
    algorithm: str,
    seal_key: SealKey | None = None,
) -> np.ndarray:
    """``count`` sealed records (``RECORD``): ``keys`` ``[count, 8]`` uint8 key digests,
    ``checksums`` uint64, ``lengths`` payload bytes, one algorithm for all. A keyed
    algorithm needs ``seal_key``: the records then carry its id and its tags over the
    ``checksums`` (the payloads' universal hashes)."""
    number = _check_algorithm(algorithm)
    if algorithm in KEYED_ALGORITHMS:
        _needed_key(algorithm, seal_key)
    elif seal_key is not None:
        raise ValueError(
            f"checksum algorithm {algorithm!r} is unkeyed: with a seal key, seal with "
            f"{sorted(KEYED_ALGORITHMS)} (an unkeyed seal is refused as a forgery)"
        )
    records = np.zeros(count, dtype=RECORD)
    records["magic"] = SEAL_MAGIC
    records["config"] = fmt.config_digest
    records["layout"] = fmt.layout_digest
    records["key"] = np.ascontiguousarray(keys, dtype=np.uint8).reshape(count, 8).view("S8")[:, 0]
    records["checksum"] = checksums
    records["length"] = lengths
    records["index"] = fmt.page_index
    records["count"] = fmt.page_count
    records["algorithm"] = number
    if algorithm in KEYED_ALGORITHMS:
        assert seal_key is not None
        records["key_id"] = seal_key.key_id
        records["checksum"] = _stored_checksums(records, records["checksum"], seal_key)
    records["check"] = header_checks(records)
    return records


def write_seal(
    page: np.ndarray,
    payload_bytes: int,
    fmt: SealFormat,
    key: bytes,
    *,
    checksum: int | None = None,
    algorithm: str = HOST_ALGORITHM,
    seal_key: SealKey | None = None,
) -> None:
    """Seal ``page`` (its first ``payload_bytes`` bytes are the chunk's bytes) with the
    given ``checksum`` of them, or, when None, the one computed here by ``algorithm``
    (keyed algorithms: with ``seal_key``, and the seal holds its tag)."""
    _check_page(page)
    _check_algorithm(algorithm)
    if not 0 <= payload_bytes <= page.size - SEAL_BYTES:
        raise ValueError(
            f"payload_bytes {payload_bytes} does not fit before the seal of a {page.size}-byte page"
        )
    if checksum is None:
        checksum = page_checksum(page[:payload_bytes], algorithm, seal_key)
    record = seal_records(
        1,
        fmt,
        np.frombuffer(key, dtype=np.uint8),
        np.array([checksum], dtype=np.uint64),
        np.array([payload_bytes]),
        algorithm,
        seal_key,
    )
    page[page.size - SEAL_BYTES :] = record.view(np.uint8)


def _record_problems(records: np.ndarray, zero: np.ndarray) -> list[str | None]:
    """Why each record is no seal of this format (None: a well-formed v2 seal)."""
    problems: list[str | None] = [None] * records.size
    magic = records["magic"]
    own = magic == SEAL_MAGIC
    checked = own & (header_checks(records) == records["check"])
    known = np.isin(records["algorithm"], list(ALGORITHM_NAMES))
    # An unkeyed seal's key id bytes are zero: set ones make it no well-formed seal.
    stray = ~np.isin(records["algorithm"], _keyed_numbers()) & (records["key_id"] != b"")
    for i in np.flatnonzero(~(checked & known) | stray).tolist():
        raw = bytes(records[i]["magic"]).ljust(8, b"\0")
        if zero[i]:
            problems[i] = "no seal (the record is all zero bytes: never stored, or a short file)"
        elif raw[:6] == SEAL_NAME and raw != SEAL_MAGIC:
            version = int.from_bytes(raw[6:8], "big")
            _count_refusal(version)
            problems[i] = (
                f"seal format v{version}, this build reads v{SEAL_VERSION} only (stored by "
                "another triton_offload release: recomputed, never misread)"
            )
        elif not own[i]:
            problems[i] = f"no seal (magic {bytes(raw)!r}, expected {SEAL_MAGIC!r})"
        elif not checked[i]:
            problems[i] = "damaged seal (its header check does not match)"
        elif not known[i]:
            problems[i] = f"unknown checksum algorithm id {int(records[i]['algorithm'])}"
        else:
            problems[i] = "damaged seal (an unkeyed seal with key id bytes set)"
    return problems


def read_seal(page: np.ndarray) -> Seal | str:
    """The page's seal, or why it has none (no magic, an old format, a damaged record)."""
    _check_page(page)
    raw = page[page.size - SEAL_BYTES :]
    records = np.frombuffer(raw.tobytes(), dtype=RECORD)
    problem = _record_problems(records, np.array([not raw.any()]))[0]
    if problem is not None:
        return problem
    record = records[0]
    return Seal(
        bytes(record["config"]).ljust(8, b"\0"),
        bytes(record["layout"]).ljust(8, b"\0"),
        bytes(record["key"]).ljust(8, b"\0"),
        int(record["length"]),
        int(record["checksum"]),
        ALGORITHM_NAMES[int(record["algorithm"])],
        int(record["index"]),
        int(record["count"]),
        bytes(record["key_id"]).ljust(KEY_ID_BYTES, b"\0"),
    )


def header_problems(
    records: np.ndarray,
    fmt: SealFormat,
    keys: np.ndarray | None,
    expected_lengths: np.ndarray | None,
    room: int,
    *,
    check_layout: bool = True,
    zero: np.ndarray | None = None,
    seal_key: SealKey | None = None,
) -> list[str | None]:
    """Why each record may not be loaded as the given chunk in format ``fmt``, or None,
    from the headers alone (O(pages x 64 B), batched): the payload checksum is checked
    where the bytes move. ``keys`` ``[n, 8]`` uint8 digests (None: not checked),
    ``expected_lengths`` the payload bytes each page's format writes (None: not
    checked), ``room`` the bytes before the seal. With ``seal_key`` only seals under that
    key pass (an unkeyed seal or another key's is a forgery); without one a keyed seal
    cannot be checked and is refused."""
    if zero is None:
        zero = ~records.view(np.uint8).reshape(-1, SEAL_BYTES).any(axis=1)
    problems = _record_problems(records, zero)
    lengths = records["length"]

    def place(i: int) -> str:
        return (
            f"page {int(records['index'][i])} of {int(records['count'][i])} where page "
            f"{fmt.page_index} of {fmt.page_count} belongs"
        )

    keyed = np.isin(records["algorithm"], _keyed_numbers())
    # In order of precedence: the first that applies names the page's problem.
    checks: list[tuple[np.ndarray, Callable[[int], str]]] = []
    if seal_key is not None:
        checks.append(
            (
                ~keyed,
                lambda i: (
                    "unkeyed seal where this engine's seal key is required (a forgery, or "
                    "stored without the key)"
                ),
            )
        )
        checks.append(
            (
                keyed & (records["key_id"] != seal_key.key_id),
                lambda i: "sealed under another seal key (a forgery, or another key's store)",
            )
        )
    else:
        checks.append(
            (
                keyed,
                lambda i: KEYED_WITHOUT_KEY,
            )
        )
    checks.append(
        (
            records["config"] != fmt.config_digest,
            lambda i: "another configuration's chunk (config digest differs)",
        )
    )
    if check_layout:
        checks.append(
            (
                records["layout"] != fmt.layout_digest,
                lambda i: "another row layout's chunk (layout digest differs)",
            )
        )
    checks.append(
        ((records["index"] != fmt.page_index) | (records["count"] != fmt.page_count), place)
    )
    if keys is not None:
        wanted = np.ascontiguousarray(keys, dtype=np.uint8).reshape(-1, 8).view("S8")[:, 0]
        checks.append(
            (records["key"] != wanted, lambda i: "another key's chunk (key digest differs)")
        )
    if expected_lengths is not None:
        expected = np.asarray(expected_lengths, dtype=np.int64)
        checks.append(
            (
                lengths != expected,
                lambda i: (
                    f"payload of {int(lengths[i])} bytes, this format writes {int(expected[i])}"
                ),
            )
        )
    checks.append(
        (lengths > room, lambda i: f"payload of {int(lengths[i])} bytes does not fit in the page")
    )
    fine = np.array([p is None for p in problems], dtype=bool)
    for mask, why in checks:
        for i in np.flatnonzero(fine & mask).tolist():
            problems[i] = why(i)
            fine[i] = False
    return problems


def seal_problem(
    page: np.ndarray,
    fmt: SealFormat,
    key: bytes | None,
    *,
    check_layout: bool = True,
    expected_payload: int | None = None,
    check_payload: bool = True,
    seal_key: SealKey | None = None,
) -> str | None:
    """Why ``page`` may not be loaded as the chunk of ``key`` in format ``fmt``, or None.

    ``key`` None skips the key check (a job given without keys). ``check_layout`` False
    checks the config digest only (the scheduler, which cannot know the worker's
    layout). ``expected_payload``: the payload length this format writes, when known.
    ``check_payload`` False checks the header only (the scheduler: the worker's load
    checks the payload where its bytes move); True recomputes the checksum here by the
    algorithm the seal names. ``seal_key``: the engine's seal key (see
    :func:`header_problems`).
    """
    _check_page(page)
    raw = page[page.size - SEAL_BYTES :]
    records = np.frombuffer(raw.tobytes(), dtype=RECORD)
    problem = header_problems(
        records,
        fmt,
        None if key is None else np.frombuffer(key, dtype=np.uint8).reshape(1, 8),
        None if expected_payload is None else np.array([expected_payload]),
        page.size - SEAL_BYTES,
        check_layout=check_layout,
        zero=np.array([not raw.any()]),
        seal_key=seal_key,
    )[0]
    if problem is not None or not check_payload:
        return problem
    seal = read_seal(page)
    assert isinstance(seal, Seal)
    value = page_checksum(page[: seal.payload_bytes], seal.algorithm, seal_key)
    stored = _stored_checksums(records, np.array([value], dtype=np.uint64), seal_key)
    if int(stored[0]) != seal.payload_checksum:
        return PAYLOAD_MISMATCH
    return None


class PageSealer:
    """Seals and checks the pages of one worker's part of a pool, headers batched.

    ``pages``: uint8 ``[num_chunks, page_bytes]`` (rows may be strided: a worker's pages
    of a shared region); ``group_payload[g]``: the bytes a row of group ``g`` uses (the
    store writes them, the checksum covers them); the seal takes the last
    :data:`SEAL_BYTES` of each page. The checksums themselves come from where the bytes
    move (the engine's copy): :meth:`seal_pages` writes headers from them and
    :meth:`expected` reads what a load must find.
    """

    def __init__(
        self,
        pages: np.ndarray,
        fmt: SealFormat,
        group_payload: Sequence[int],
        seal_key: SealKey | None = None,
    ) -> None:
        if seal_key is not None and not isinstance(seal_key, SealKey):
            raise TypeError(f"seal_key must be a SealKey or None, got {type(seal_key).__name__}")
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
        self._pages: np.ndarray | None = pages
        self.format = fmt
        #: With a key, pages are sealed with its tags and only its seals are accepted.
        self.seal_key = seal_key
        self.group_payload = tuple(int(p) for p in group_payload)
        self._payload = np.array(self.group_payload, dtype=np.int64)
        # The seal as eight little-endian u64 words (the fast path of sealing and
        # checking): 0-2 magic, config and layout digests (the same on every page),
        # 3 key digest, 4 payload checksum (keyed: the tag), 5 length | index << 32 |
        # count << 48 (by group), 6 algorithm id | key id << 8 (zero without a key),
        # 7 header check.
        fixed = np.frombuffer(SEAL_MAGIC + fmt.config_digest + fmt.layout_digest, dtype="<u8")
        place = (
            self._payload.astype(np.uint64)
            | np.uint64(fmt.page_index << 32)
            | np.uint64(fmt.page_count << 48)
        )
        #: Per group, the seal's words that do not depend on the page (0-2 and 5; 6 per
        #: algorithm, added in :meth:`_templates`), words 3 and 4 zero.
        self._group_words = np.zeros((len(self.group_payload), 8), dtype="<u8")
        self._group_words[:, :3] = fixed
        self._group_words[:, 5] = place
        self._templates_by_algorithm: dict[str, np.ndarray] = {}
        #: Pages this sealer checked on the host because their seal names an algorithm
        #: the load's path does not compute (a page sealed on another kind of host).
        self.host_checked_pages = 0

    @property
    def pages(self) -> np.ndarray:
        """The pages sealed and checked; RuntimeError once :meth:`close` dropped them."""
        if self._pages is None:
            raise RuntimeError("this page sealer is closed: its view of the pool was dropped")
        return self._pages

    @property
    def room(self) -> int:
        return int(self.pages.shape[1]) - SEAL_BYTES

    def close(self) -> None:
        """Drop the view of the pool (idempotent); every later use raises RuntimeError.
        The pool's owner cannot unmap memory a view still exports (vLLM's region then
        stays mapped: "Keeping ... mapped")."""
        self._pages = None

    def records(self, chunks: np.ndarray) -> np.ndarray:
        """A copy of the seal records of ``chunks`` (``RECORD``)."""
        raw = self.pages[np.asarray(chunks, dtype=np.int64), self.room :]
        return np.ascontiguousarray(raw).view(RECORD).reshape(-1)

    def _templates(self, algorithm: str) -> np.ndarray:
        """Per group, the seal of a page by ``algorithm`` with key digest and checksum
        zero (``[groups, 8]`` u64): word 7 holds the header check of the other words,
        to which the page's words 3 and 4 add their own share (the check is a sum)."""
        templates = self._templates_by_algorithm.get(algorithm)
        if templates is None:
            number = _check_algorithm(algorithm)
            keyed = algorithm in KEYED_ALGORITHMS
            if keyed != (self.seal_key is not None):
                raise ValueError(
                    f"checksum algorithm {algorithm!r} with "
                    f"{'a' if self.seal_key is not None else 'no'} seal key: a keyed sealer "
                    "seals and accepts keyed checksums only, an unkeyed one unkeyed ones"
                )
            templates = self._group_words.copy()
            templates[:, 6] = number
            if self.seal_key is not None:
                templates[:, 6] |= _key_id_word(self.seal_key)
            templates[:, 7] = _header_words_check(templates)
            templates.flags.writeable = False
            self._templates_by_algorithm[algorithm] = templates
        return templates

    def _words(
        self, groups: np.ndarray, keys: np.ndarray, checksums: np.ndarray, algorithm: str
    ) -> np.ndarray:
        """The seals of pages of ``groups`` with these key digests and checksums, as
        ``[n, 8]`` u64 words, header checks included (the bytes :func:`seal_records`
        writes, built without a structured array)."""
        words = self._templates(algorithm)[groups]
        words[:, 3] = np.ascontiguousarray(keys, dtype=np.uint8).reshape(-1, 8).view("<u8")[:, 0]
        if self.seal_key is not None:
            words[:, 4] = self.seal_key.tags(words, np.asarray(checksums, dtype=np.uint64))
        else:
            words[:, 4] = checksums
        # The check's share of words 3 and 4 (u32 halves 6-9 of the sum).
        words[:, 7] += words[:, 3:5].view("<u4").astype(np.uint64) @ _PAGE_WORD_WEIGHTS
        return words

    def seal_pages(
        self,
        chunks: np.ndarray,
        groups: np.ndarray,
        keys: np.ndarray,
        checksums: np.ndarray,
        algorithm: str,
    ) -> None:
        """Seal the pages of ``chunks`` (their groups, ``[n, 8]`` key digests and the
        checksums their copy computed), all headers in one batch."""
        words = self._words(np.asarray(groups), keys, checksums, algorithm)
        self.pages[np.asarray(chunks, dtype=np.int64), self.room :] = words.view(np.uint8)

    def accepted(
        self,
        chunks: np.ndarray,
        groups: np.ndarray,
        keys: np.ndarray | None,
        checksums: np.ndarray,
        algorithm: str,
    ) -> np.ndarray:
        """Which pages hold exactly the seal a store of them with these key digests
        (None: any key) and payload checksums (by ``algorithm``) writes: the whole
        verdict of a page as one comparison of its 64 seal bytes (bool ``[n]``). A page
        not accepted here has a problem :meth:`header_problems` and
        :meth:`payload_problems` name (or was sealed by the other algorithm)."""
        stored, expected = self._stored_and_expected(chunks, groups, keys, checksums, algorithm)
        return (stored == expected).all(axis=1)

    def all_accepted(
        self,
        chunks: np.ndarray,
        groups: np.ndarray,
        keys: np.ndarray | None,
        checksums: np.ndarray,
        algorithm: str,
    ) -> bool:
        """Whether :meth:`accepted` holds for every page (one comparison of the job's
        seal bytes: a load's common case, no per-page verdict built)."""
        stored, expected = self._stored_and_expected(chunks, groups, keys, checksums, algorithm)
        return stored.tobytes() == expected.tobytes()

    def _stored_and_expected(
        self,
        chunks: np.ndarray,
        groups: np.ndarray,
        keys: np.ndarray | None,
        checksums: np.ndarray,
        algorithm: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The seals the pages hold and those a store would have written, ``[n, 8]`` u64."""
        # Indexing with an array gives a new C-contiguous array: viewable as words.
        stored = self.pages[np.asarray(chunks, dtype=np.int64), self.room :]
        if keys is None:
            # Any key: expect the stored one.
            keys = stored[:, 24:32]
        expected = self._words(np.asarray(groups), keys, checksums, algorithm)
        return stored.view("<u8"), expected

    def seal(self, chunk: int, group: int, key: bytes, algorithm: str | None = None) -> None:
        """Seal one page, its checksum computed here on the host (tests, tools); the
        default algorithm is the host's (keyed with a key)."""
        if algorithm is None:
            algorithm = checksum_algorithm(False, self.seal_key is not None)
        write_seal(
            self.pages[chunk],
            self.group_payload[group],
            self.format,
            key,
            algorithm=algorithm,
            seal_key=self.seal_key,
        )

    def header_problems(
        self, chunks: np.ndarray, groups: np.ndarray, keys: np.ndarray | None
    ) -> tuple[list[str | None], np.ndarray]:
        """Each page's header problem (or None) and the records read, batched."""
        records = self.records(chunks)
        problems = header_problems(
            records,
            self.format,
            keys,
            self._payload[np.asarray(groups)],
            self.room,
            seal_key=self.seal_key,
        )
        return problems, records

    def payload_problems(
        self,
        chunks: np.ndarray,
        records: np.ndarray,
        problems: list[str | None],
        checksums: np.ndarray | None,
        algorithm: str | None,
    ) -> list[str | None]:
        """``problems`` completed with the payload verdict: each page whose header was
        fine and whose ``checksums[i]`` (by ``algorithm``, what the copy computed) differs
        from its seal's; a page sealed with another algorithm is checked here on the host."""
        result = list(problems)
        fine = np.array([p is None for p in problems], dtype=bool)
        if not fine.any():
            return result
        names = np.array([ALGORITHM_NAMES.get(int(a), "") for a in records["algorithm"]])
        computed = checksums if checksums is not None else np.zeros(len(result), np.uint64)
        same = fine & (names == algorithm) if checksums is not None else np.zeros_like(fine)
        other = np.flatnonzero(fine & ~same)
        if other.size:
            self.host_checked_pages += int(other.size)
            computed = computed.copy()
            for i in other.tolist():
                length = int(records[i]["length"])
                computed[i] = page_checksum(
                    self.pages[int(chunks[i]), :length], str(names[i]), self.seal_key
                )
        stored = _stored_checksums(records, computed, self.seal_key)
        bad = np.flatnonzero(fine & (stored != records["checksum"]))
        for i in bad.tolist():
            result[i] = PAYLOAD_MISMATCH
        return result

    def problem(self, chunk: int, group: int, key: bytes | None) -> str | None:
        """One page's whole verdict, payload recomputed here (tests, tools)."""
        return seal_problem(
            self.pages[chunk],
            self.format,
            key,
            expected_payload=self.group_payload[group],
            seal_key=self.seal_key,
        )


def layout_description(planes: Sequence[Plane], blocks_per_chunk: int) -> str:
    """The text a layout digest is taken of: every plane's group, pool offset and page
    bytes in order, the chunk's block count and :data:`ROW_LAYOUT_VERSION` (two K/V
    planes and one fused plane of the same bytes differ here)."""
    parts = [f"rows-v{ROW_LAYOUT_VERSION}", f"bpc{blocks_per_chunk}"]
    parts += [f"g{p.group}@{p.pool_offset}x{p.page_bytes}" for p in planes]
    return ";".join(parts)


__all__ = [
    "ALGORITHMS",
    "DEVICE_ALGORITHM",
    "HOST_ALGORITHM",
    "KEYED_ALGORITHMS",
    "KEYED_DEVICE_ALGORITHM",
    "KEYED_HOST_ALGORITHM",
    "KEYED_WITHOUT_KEY",
    "NO_KEY",
    "PAYLOAD_MISMATCH",
    "RECORD",
    "SEAL_BYTES",
    "SEAL_MAGIC",
    "PageSealer",
    "Seal",
    "SealFormat",
    "checksum_algorithm",
    "digest8",
    "header_problems",
    "key_digest",
    "key_digests",
    "layout_description",
    "page_checksum",
    "page_checksums",
    "read_seal",
    "refused_formats",
    "seal_problem",
    "seal_records",
    "write_seal",
]
