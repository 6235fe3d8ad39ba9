"""The chunk seal, judged from its format (not from the code that writes it).

Seal format v2: the last 64 bytes of a page, little-endian:

====== ===== ==============================================================
0      8     magic ``TOSEAL\\x00\\x02`` (name, then the version, big-endian)
8      8     config digest
16     8     layout digest
24     8     key digest (XXH3-64 of the key, seed 0, 8 big-endian bytes; zero for no key)
32     8     payload checksum (u64)
40     4     payload length (u32): bytes at the start of the page it covers
44     2     page index (u16); 46 2: page count (u16)
48     1     algorithm (u8): 1 ``wsum64``, 2 ``xxh3_64``
49     7     zero
56     8     header check (u64): ``wsum64`` of bytes 0..55 of the record
====== ===== ==============================================================

``wsum64``: ``w_j`` the little-endian u32 words of the payload (the last one
zero-padded), ``h(j) = ((2j + 1) * 0x9E3779B1) mod 2**32``, the checksum is
``sum_j w_j * h(j) mod 2**64``. ``xxh3_64``: XXH3-64 with seed 0.

Every expected value below is computed here from these rules (struct, xxhash and a
pure-Python ``wsum64``); the module is only called, never used to build an expectation.
Format v1 (``TOSEAL\\x00\\x01``, zlib CRC-32) is obsolete: refused, named and counted.

Keyed seals (section 8: algorithms 3 ``keyed_wsum64`` and 4 ``keyed_ghash64``, the key
id in bytes 49-55, the checksum field a tag) are judged by
``tests/helpers/keyed_seal_judge.py``, written from the docstrings of ``seal.py`` and
``seal_key.py``; the attacks a key must stop are made here byte by byte.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import xxhash

from tests.helpers import keyed_seal_judge as judge
from triton_offload.transfer.seal import (
    NO_KEY,
    SEAL_BYTES,
    SEAL_MAGIC,
    PageSealer,
    Seal,
    SealFormat,
    digest8,
    key_digest,
    layout_description,
    page_checksum,
    page_checksums,
    read_seal,
    refused_formats,
    seal_problem,
    write_seal,
)
from triton_offload.transfer.seal_key import SealKey

PAGE = 1024
PAYLOAD = 700
MAGIC_V2 = b"TOSEAL\x00\x02"
MAGIC_V1 = b"TOSEAL\x00\x01"
ALGORITHM_IDS = {"wsum64": 1, "xxh3_64": 2}
CONFIG = b"config\x00\x01"
LAYOUT = b"layout\x00\x01"
FMT = SealFormat(CONFIG, LAYOUT, 1, 4)
KEY = xxhash.xxh3_64(b"chunk-key").digest()
MASK64 = (1 << 64) - 1


# --- the rules, written out here ------------------------------------------------------


def wsum64(payload: bytes) -> int:
    """The rule, word by word in Python integers."""
    padded = payload + bytes(-len(payload) % 4)
    total = 0
    for j in range(len(padded) // 4):
        (word,) = struct.unpack_from("<I", padded, 4 * j)
        total += word * (((2 * j + 1) * 0x9E3779B1) % 2**32)
    return total % 2**64


def checksum(payload: bytes, algorithm: str) -> int:
    if algorithm == "wsum64":
        return wsum64(payload)
    assert algorithm == "xxh3_64"
    return xxhash.xxh3_64_intdigest(payload)


def v2_record(
    *,
    length: int,
    payload_checksum: int,
    algorithm_id: int,
    config: bytes = CONFIG,
    layout: bytes = LAYOUT,
    key: bytes = KEY,
    index: int = 1,
    count: int = 4,
    magic: bytes = MAGIC_V2,
) -> bytes:
    head = (
        magic
        + config
        + layout
        + key
        + struct.pack("<QIHHB", payload_checksum, length, index, count, algorithm_id)
        + bytes(7)
    )
    assert len(head) == 56
    return head + struct.pack("<Q", wsum64(head))


def expected_record(page_bytes: bytes, length: int, algorithm: str, key: bytes = KEY) -> bytes:
    return v2_record(
        length=length,
        payload_checksum=checksum(page_bytes[:length], algorithm),
        algorithm_id=ALGORITHM_IDS[algorithm],
        key=key,
    )


def v1_record(payload: bytes, length: int, key: bytes = KEY) -> bytes:
    fields = (
        MAGIC_V1
        + CONFIG
        + LAYOUT
        + key
        + struct.pack("<IIHH", length, zlib.crc32(payload[:length]), 1, 4)
        + bytes(16)
    )
    assert len(fields) == 60
    return fields + struct.pack("<I", zlib.crc32(fields))


def page(seed: int = 0, size: int = PAGE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sealed(algorithm: str = "xxh3_64", seed: int = 0) -> np.ndarray:
    data = page(seed)
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm)
    return data


def put_record(data: np.ndarray, record: bytes) -> np.ndarray:
    data[-SEAL_BYTES:] = np.frombuffer(record, dtype=np.uint8)
    return data


def problem_of(data: np.ndarray, fmt: SealFormat = FMT, key: bytes | None = KEY, **kw) -> str:
    found = seal_problem(data, fmt, key, **kw)
    assert found is not None, "the page was accepted"
    return found


# --- 1. the record and the checksums --------------------------------------------------


def test_the_rules_constants_and_digests() -> None:
    assert SEAL_BYTES == 64
    assert SEAL_MAGIC == MAGIC_V2
    assert key_digest(b"chunk-key") == KEY
    assert key_digest(None) == bytes(8)
    assert digest8(b"config") == hashlib.blake2b(b"config", digest_size=8).digest()
    # wsum64 of nothing is the empty sum; of one byte, that byte times h(0).
    assert wsum64(b"") == 0
    assert wsum64(b"\x07") == 7 * 0x9E3779B1


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_the_seal_is_the_documented_record_and_touches_nothing_else(algorithm: str) -> None:
    data = page()
    before = data.copy()
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm)
    assert np.array_equal(data[: PAGE - SEAL_BYTES], before[: PAGE - SEAL_BYTES])
    assert data[PAGE - SEAL_BYTES :].tobytes() == expected_record(
        before.tobytes(), PAYLOAD, algorithm
    )
    assert seal_problem(data, FMT, KEY) is None
    assert seal_problem(data, FMT, None) is None  # no key given: the key is not checked

    seal = read_seal(data)
    assert isinstance(seal, Seal), seal
    payload = before[:PAYLOAD].tobytes()
    assert seal == Seal(
        config_digest=CONFIG,
        layout_digest=LAYOUT,
        key_digest=KEY,
        payload_bytes=PAYLOAD,
        payload_checksum=checksum(payload, algorithm),
        algorithm=algorithm,
        page_index=1,
        page_count=4,
    )
    assert seal.payload_checksum == page_checksum(payload, algorithm)


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_a_given_checksum_is_written_as_given(algorithm: str) -> None:
    data = page()
    before = data.copy()
    write_seal(data, PAYLOAD, FMT, KEY, checksum=0xDEADBEEF_01234567, algorithm=algorithm)
    assert np.array_equal(data[: PAGE - SEAL_BYTES], before[: PAGE - SEAL_BYTES])
    assert data[PAGE - SEAL_BYTES :].tobytes() == v2_record(
        length=PAYLOAD, payload_checksum=0xDEADBEEF_01234567, algorithm_id=ALGORITHM_IDS[algorithm]
    )
    # A header that is whole, over a payload that does not match it.
    assert "payload checksum" in problem_of(data)
    assert seal_problem(data, FMT, KEY, check_payload=False) is None


def test_the_default_algorithm_is_xxh3_and_no_key_is_eight_zero_bytes() -> None:
    data = page()
    before = data.copy()
    write_seal(data, 0, FMT, bytes(8))
    assert data[PAGE - SEAL_BYTES :].tobytes() == expected_record(
        before.tobytes(), 0, "xxh3_64", key=bytes(8)
    )
    assert seal_problem(data, FMT, None) is None
    assert seal_problem(data, FMT, key_digest(None)) is None
    assert page_checksum(b"abcde") == xxhash.xxh3_64_intdigest(b"abcde")


@pytest.mark.parametrize("length", [0, 1, 3, 5, 4095, 70001])
def test_page_checksum_is_the_rule(length: int) -> None:
    payload = page(length, length).tobytes()
    array = np.frombuffer(payload, dtype=np.uint8)
    for algorithm in ("wsum64", "xxh3_64"):
        expected = checksum(payload, algorithm)
        assert page_checksum(payload, algorithm) == expected, algorithm
        assert page_checksum(array, algorithm=algorithm) == expected, algorithm
    assert page_checksum(payload) == xxhash.xxh3_64_intdigest(payload)


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_page_checksums_of_a_strided_pool(algorithm: str) -> None:
    region = page(3, 6 * 2 * 512).reshape(6, 2 * 512)
    pages = region[:, 512:]  # rows 2 pages apart
    rows = np.array([5, 0, 3, 3, 1], dtype=np.int64)
    lengths = np.array([512 - 64, 1, 7, 300, 0], dtype=np.int64)
    got = page_checksums(pages, rows, lengths, algorithm)
    assert got.dtype == np.uint64
    expected = [
        checksum(pages[r, :n].tobytes(), algorithm) for r, n in zip(rows, lengths, strict=True)
    ]
    assert [int(x) for x in got] == expected


# --- 2. what wsum64 promises ----------------------------------------------------------


def test_wsum64_sees_every_single_bit_flip() -> None:
    payload = bytearray(page(7, 64).tobytes())
    base = wsum64(bytes(payload))
    assert page_checksum(bytes(payload), "wsum64") == base
    for bit in range(64 * 8):
        payload[bit // 8] ^= 1 << (bit % 8)
        assert page_checksum(bytes(payload), "wsum64") != base, bit
        payload[bit // 8] ^= 1 << (bit % 8)


def test_wsum64_sees_every_swap_of_two_different_words() -> None:
    words = list(struct.unpack("<16I", page(8, 64).tobytes()))
    assert len(set(words)) == 16
    base = page_checksum(struct.pack("<16I", *words), "wsum64")
    for a in range(16):
        for b in range(a + 1, 16):
            swapped = list(words)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            assert page_checksum(struct.pack("<16I", *swapped), "wsum64") != base, (a, b)


@pytest.mark.parametrize("length", [1, 3, 4, 61])
def test_wsum64_trailing_zero_bytes_add_nothing(length: int) -> None:
    payload = page(9, length).tobytes()
    base = wsum64(payload)
    for extra in (1, 2, 3, 4, 9):
        assert page_checksum(payload + bytes(extra), "wsum64") == base, extra


def test_wsum64_is_linear_over_disjoint_byte_masks() -> None:
    rng = np.random.default_rng(10)
    payload = rng.integers(0, 256, 1001, dtype=np.uint8)
    part = rng.integers(0, 4, payload.size)  # parts 0, 1, 2 kept; 3 zeroed everywhere
    kept = np.where(part < 3, payload, 0).astype(np.uint8)
    parts = [np.where(part == p, payload, 0).astype(np.uint8) for p in range(3)]
    total = sum(page_checksum(p.tobytes(), "wsum64") for p in parts) % 2**64
    assert total == page_checksum(kept.tobytes(), "wsum64") == wsum64(kept.tobytes())


# --- 3. refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4, 350, 697, 698, 699])
def test_any_flipped_payload_byte_is_refused(algorithm: str, offset: int) -> None:
    data = sealed(algorithm)
    data[offset] ^= 0x01
    assert "payload checksum" in problem_of(data)


def test_bytes_after_the_payload_are_not_covered() -> None:
    """Only what the store wrote is covered: padding between payload and seal may hold
    anything (a group with a shorter row leaves the rest of the page untouched)."""
    for algorithm in ("wsum64", "xxh3_64"):
        data = sealed(algorithm)
        data[PAYLOAD] ^= 0xFF
        data[PAGE - SEAL_BYTES - 1] ^= 0xFF
        assert seal_problem(data, FMT, KEY) is None, algorithm


@pytest.mark.parametrize("offset", range(8, SEAL_BYTES))
def test_a_damaged_header_byte_is_told_apart(offset: int) -> None:
    data = sealed("wsum64")
    data[PAGE - SEAL_BYTES + offset] ^= 0x10
    assert "damaged" in problem_of(data)
    assert "damaged" in problem_of(data, check_payload=False)
    found = read_seal(data)
    assert isinstance(found, str) and "damaged" in found


@pytest.mark.parametrize("offset", range(8))
def test_a_damaged_magic_is_no_valid_seal(offset: int) -> None:
    data = sealed()
    data[PAGE - SEAL_BYTES + offset] ^= 0x10
    assert isinstance(read_seal(data), str)
    problem_of(data)


def test_what_else_a_page_can_be() -> None:
    data = sealed()
    assert "another key" in problem_of(data, key=key_digest(b"other"))
    other_layout = SealFormat(CONFIG, b"fused\x00\x00\x01", 1, 4)
    assert "row layout" in problem_of(data, other_layout)
    # The scheduler checks a promoted page without the layout digest.
    assert seal_problem(data, other_layout, KEY, check_layout=False) is None
    other_config = SealFormat(b"tp2\x00\x00\x00\x00\x01", LAYOUT, 1, 4)
    assert "configuration" in problem_of(data, other_config)
    assert "configuration" in problem_of(data, other_config, check_layout=False)
    other_page = SealFormat(CONFIG, LAYOUT, 2, 4)
    place = problem_of(data, other_page)
    assert "page 1 of 4" in place and "2 of 4" in place, place
    assert "payload of 700" in problem_of(data, expected_payload=512)
    assert seal_problem(data, FMT, KEY, expected_payload=PAYLOAD) is None


def test_no_seal_at_all() -> None:
    zeros = np.zeros(PAGE, dtype=np.uint8)
    assert "no seal" in problem_of(zeros)
    assert "no seal" in problem_of(page(5))  # garbage
    assert "no seal" in problem_of(zeros, check_payload=False)
    for data in (zeros, page(5)):
        found = read_seal(data)
        assert isinstance(found, str) and "no seal" in found


def test_an_unknown_algorithm_with_a_whole_header_is_refused() -> None:
    data = page()
    payload = data[:PAYLOAD].tobytes()
    put_record(data, v2_record(length=PAYLOAD, payload_checksum=wsum64(payload), algorithm_id=7))
    assert "unknown checksum algorithm" in problem_of(data)
    found = read_seal(data)
    assert isinstance(found, str) and "unknown checksum algorithm" in found


# --- 4. format v1 ---------------------------------------------------------------------


def test_a_v1_seal_is_refused_by_name_and_counted() -> None:
    data = page()
    put_record(data, v1_record(data.tobytes(), PAYLOAD))
    for check_payload in (True, False):
        before = refused_formats().get(1, 0)
        problem = problem_of(data, check_payload=check_payload)
        assert "v1" in problem, problem
        assert refused_formats().get(1, 0) == before + 1
    found = read_seal(data)
    assert isinstance(found, str) and "v1" in found
    # Once more, with every other check off: still never accepted.
    assert seal_problem(data, FMT, None, check_layout=False, check_payload=False) is not None


def test_a_v1_seal_is_refused_by_the_sealer_and_counted() -> None:
    pages = page(11, 2 * PAGE).reshape(2, PAGE)
    sealer = PageSealer(pages, FMT, [PAYLOAD])
    put_record(pages[1], v1_record(pages[1].tobytes(), PAYLOAD))
    before = refused_formats().get(1, 0)
    problems, _ = sealer.header_problems(
        np.array([1]), np.array([0]), np.frombuffer(KEY, np.uint8)[None, :].copy()
    )
    assert "v1" in (problems[0] or "")
    assert refused_formats().get(1, 0) == before + 1


# --- 5. the header-only verdict -------------------------------------------------------


def test_check_payload_false_checks_the_header_only() -> None:
    data = sealed("wsum64")
    data[3] ^= 0x40
    assert seal_problem(data, FMT, KEY, check_payload=False) is None
    assert "payload checksum" in problem_of(data)
    assert "another key" in problem_of(data, key=key_digest(b"other"), check_payload=False)
    other_config = SealFormat(b"tp2\x00\x00\x00\x00\x01", LAYOUT, 1, 4)
    assert "configuration" in problem_of(data, other_config, check_payload=False)


# --- 6. the sealer over a strided pool ------------------------------------------------

GROUP_PAYLOAD = [300, 900]
ROWS = 8


def strided_pool(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    region = page(seed, ROWS * 2 * PAGE).reshape(ROWS, 2 * PAGE)
    return region, region[:, PAGE:]  # the second worker's pages: rows 2 pages apart


def key_rows(keys: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 8).copy()


def test_the_sealer_seals_one_row_of_a_strided_pool() -> None:
    region, pages = strided_pool()
    before = region.copy()
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD)
    sealer.seal(2, 1, KEY)
    changed = np.argwhere(region != before)
    assert {int(r) for r, _ in changed} == {2}
    assert all(int(c) >= 2 * PAGE - SEAL_BYTES for _, c in changed)
    assert region[2, -SEAL_BYTES:].tobytes() == expected_record(
        before[2, PAGE:].tobytes(), 900, "xxh3_64"
    )
    assert sealer.problem(2, 1, KEY) is None
    assert "payload of 900" in (sealer.problem(2, 0, KEY) or "")
    assert "no seal" in (sealer.problem(0, 0, KEY) or "")
    sealer.seal(3, 0, KEY, algorithm="wsum64")
    assert region[3, -SEAL_BYTES:].tobytes() == expected_record(
        before[3, PAGE:].tobytes(), 300, "wsum64"
    )


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_seal_pages_writes_only_the_named_seals(algorithm: str) -> None:
    region, pages = strided_pool()
    before = region.copy()
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD)
    chunks = np.array([6, 1, 4], dtype=np.int64)
    groups = np.array([0, 1, 1], dtype=np.int64)
    keys = [key_digest(b"a"), key_digest(b"b"), bytes(8)]
    sums = np.array(
        [
            checksum(pages[c, : GROUP_PAYLOAD[g]].tobytes(), algorithm)
            for c, g in zip(chunks, groups, strict=True)
        ],
        dtype=np.uint64,
    )
    sealer.seal_pages(chunks, groups, key_rows(keys), sums, algorithm)

    expected = before.copy()
    for c, g, k in zip(chunks, groups, keys, strict=True):
        expected[c, -SEAL_BYTES:] = np.frombuffer(
            expected_record(before[c, PAGE:].tobytes(), GROUP_PAYLOAD[g], algorithm, key=k),
            dtype=np.uint8,
        )
    assert np.array_equal(region, expected)
    for c, g, k in zip(chunks, groups, keys, strict=True):
        assert seal_problem(pages[c], FMT, k, expected_payload=GROUP_PAYLOAD[g]) is None


def mixed_pool(algorithm: str):
    """Rows sealed by ``algorithm``, then spoiled in as many ways as a load can meet."""
    _, pages = strided_pool(4)
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD)
    keys = [key_digest(f"chunk-{c}".encode()) for c in range(ROWS)]
    groups = np.array([c % 2 for c in range(ROWS)], dtype=np.int64)
    all_rows = np.arange(ROWS, dtype=np.int64)
    sums = np.array(
        [checksum(pages[c, : GROUP_PAYLOAD[g]].tobytes(), algorithm) for c, g in enumerate(groups)],
        dtype=np.uint64,
    )
    sealer.seal_pages(all_rows, groups, key_rows(keys), sums, algorithm)
    # row 0 good, 1 good
    pages[2, 17] ^= 0x02  # flipped payload byte
    keys[3] = key_digest(b"another")  # the load asks for another key
    pages[4, -20] ^= 0x01  # damaged header
    pages[5, -SEAL_BYTES:] = 0  # no seal
    groups = groups.copy()
    groups[6] = 1  # the load expects another group's row length
    pages[7, GROUP_PAYLOAD[1] - 1] ^= 0x80  # last payload byte of a 900-byte row
    expect = [None, None, "payload checksum", "another key", "damaged", "no seal", "payload of"]
    expect.append("payload checksum")
    return sealer, pages, all_rows, groups, keys, expect


def host_verdicts(pages, rows, groups, keys) -> list[str | None]:
    return [
        seal_problem(pages[c], FMT, keys[c], expected_payload=GROUP_PAYLOAD[g])
        for c, g in zip(rows, groups, strict=True)
    ]


def assert_verdicts(found: list[str | None], expect: list[str | None]) -> None:
    assert len(found) == len(expect)
    for i, (f, e) in enumerate(zip(found, expect, strict=True)):
        if e is None:
            assert f is None, (i, f)
        else:
            assert f is not None and e in f, (i, f, e)


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_batched_verdicts_agree_with_each_page_s(algorithm: str) -> None:
    sealer, pages, rows, groups, keys, expect = mixed_pool(algorithm)
    single = host_verdicts(pages, rows, groups, keys)
    assert_verdicts(single, expect)

    headers, records = sealer.header_problems(rows, groups, key_rows(keys))
    header_expect = [None if e == "payload checksum" else e for e in expect]
    assert_verdicts(list(headers), header_expect)

    # The copy computed the checksums of what it moved, by the seal's algorithm.
    sums = np.array(
        [
            checksum(pages[c, : GROUP_PAYLOAD[g]].tobytes(), algorithm)
            for c, g in zip(rows, groups, strict=True)
        ],
        dtype=np.uint64,
    )
    host_before = sealer.host_checked_pages
    found = sealer.payload_problems(rows, records, list(headers), sums, algorithm)
    assert_verdicts(list(found), expect)
    assert sealer.host_checked_pages == host_before  # nothing checked on the host
    for i, (f, s) in enumerate(zip(found, single, strict=True)):
        assert (f is None) == (s is None), (i, f, s)


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_checksums_of_another_algorithm_are_checked_on_the_host(algorithm: str) -> None:
    sealer, pages, rows, groups, keys, expect = mixed_pool(algorithm)
    other = "xxh3_64" if algorithm == "wsum64" else "wsum64"
    headers, records = sealer.header_problems(rows, groups, key_rows(keys))
    whole_headers = sum(1 for h in headers if h is None)
    sums = np.array(
        [
            checksum(pages[c, : GROUP_PAYLOAD[g]].tobytes(), other)
            for c, g in zip(rows, groups, strict=True)
        ],
        dtype=np.uint64,
    )
    host_before = sealer.host_checked_pages
    found = sealer.payload_problems(rows, records, list(headers), sums, other)
    assert_verdicts(list(found), expect)
    assert sealer.host_checked_pages == host_before + whole_headers


def test_header_problems_without_keys_skip_the_key() -> None:
    sealer, _, rows, groups, _, _ = mixed_pool("wsum64")
    headers, _ = sealer.header_problems(rows, groups, None)
    assert headers[3] is None  # the key is not checked
    assert "damaged" in (headers[4] or "")


# --- 7. bad arguments -----------------------------------------------------------------


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="payload_bytes 961"):
        write_seal(page(), PAGE - SEAL_BYTES + 1, FMT, KEY)
    with pytest.raises(TypeError, match="1-D uint8"):
        write_seal(np.zeros(PAGE, dtype=np.int8), 10, FMT, KEY)
    with pytest.raises(TypeError, match="1-D uint8"):
        write_seal(np.zeros((2, PAGE), dtype=np.uint8), 10, FMT, KEY)
    with pytest.raises(ValueError, match="crc32"):
        write_seal(page(), 10, FMT, KEY, algorithm="crc32")
    with pytest.raises(ValueError, match="crc32"):
        page_checksum(b"abc", "crc32")
    with pytest.raises(ValueError, match="page 4 of 4"):
        SealFormat(CONFIG, LAYOUT, 4, 4)
    with pytest.raises(ValueError, match="config_digest must be 8 bytes"):
        SealFormat(b"short", LAYOUT, 0, 1)
    with pytest.raises(ValueError, match="group 1's 1000-byte row"):
        PageSealer(np.zeros((2, PAGE), dtype=np.uint8), FMT, [10, 1000])


def test_split_and_fused_planes_of_the_same_bytes_have_different_layouts() -> None:
    def plane(offset: int, page: int) -> SimpleNamespace:
        return SimpleNamespace(group=0, pool_offset=offset, page_bytes=page)

    split = layout_description([plane(0, 512), plane(1024, 512)], 2)  # type: ignore[list-item]
    fused = layout_description([plane(0, 1024)], 2)  # type: ignore[list-item]
    assert split != fused
    assert digest8(split) != digest8(fused)


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3_64"])
def test_accepted_is_true_exactly_where_each_page_s_verdict_is_none(algorithm: str) -> None:
    sealer, pages, rows, groups, keys, _ = mixed_pool(algorithm)
    sums = np.array(
        [
            checksum(pages[c, : GROUP_PAYLOAD[g]].tobytes(), algorithm)
            for c, g in zip(rows, groups, strict=True)
        ],
        dtype=np.uint64,
    )
    fine = [verdict is None for verdict in host_verdicts(pages, rows, groups, keys)]
    assert sealer.accepted(rows, groups, key_rows(keys), sums, algorithm).tolist() == fine
    # The job-wide verdict: every page, or only the fine ones.
    assert not sealer.all_accepted(rows, groups, key_rows(keys), sums, algorithm)
    good = np.flatnonzero(fine)
    assert good.size > 0
    assert sealer.all_accepted(
        rows[good], groups[good], key_rows([keys[i] for i in good]), sums[good], algorithm
    )
    # Without keys the key is not checked: the page a load asked for under another key
    # is accepted, the others as before.
    anykey = sealer.accepted(rows, groups, None, sums, algorithm).tolist()
    assert anykey == [f or i == 3 for i, f in enumerate(fine)]
    # Checksums by the other algorithm accept nothing (checked on the host instead).
    other = "xxh3_64" if algorithm == "wsum64" else "wsum64"
    assert not sealer.accepted(rows, groups, key_rows(keys), sums, other).any()


@pytest.mark.parametrize("offset", range(SEAL_BYTES))
def test_accepted_refuses_a_page_with_any_seal_byte_changed(offset: int) -> None:
    _, pages = strided_pool()
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD)
    rows, groups = np.array([2, 5], dtype=np.int64), np.array([0, 1], dtype=np.int64)
    keys = key_rows([key_digest(b"x"), key_digest(b"y")])
    sums = np.array([11, 2**64 - 3], dtype=np.uint64)
    sealer.seal_pages(rows, groups, keys, sums, "xxh3_64")
    assert sealer.accepted(rows, groups, keys, sums, "xxh3_64").tolist() == [True, True]
    assert sealer.all_accepted(rows, groups, keys, sums, "xxh3_64")
    pages[5, pages.shape[1] - SEAL_BYTES + offset] ^= 0x10
    assert sealer.accepted(rows, groups, keys, sums, "xxh3_64").tolist() == [True, False]
    assert sealer.accepted(rows, groups, None, sums, "xxh3_64").tolist() == [True, False]
    assert not sealer.all_accepted(rows, groups, keys, sums, "xxh3_64")
    assert not sealer.all_accepted(rows, groups, None, sums, "xxh3_64")


# --- 8. keyed seals -------------------------------------------------------------------

KEYED = ["keyed_wsum64", "keyed_ghash64"]
SECRET = bytes(range(100, 132))
OTHER_SECRET = bytes(range(200, 232))
PAYLOAD_MISMATCH_TEXT = "payload checksum mismatch"
#: Payload lengths a keyed seal covers: empty, not multiples of 4, the whole room.
KEYED_LENGTHS = [0, 1, 2, 3, 5, 6, 7, 8, 700, 957, PAGE - SEAL_BYTES]
#: (page index, page count) of a row: the first of one, a middle one, the last of most.
PLACES = [(0, 1), (1, 4), (65534, 65535)]
KEY_DIGESTS = [NO_KEY, KEY, bytes(range(1, 9)), b"\xff" * 8]
ATTACK_ROWS = 200
ATTACK_PAYLOAD = [300, 957]  # by group


def keyed_seal_of(
    payload: bytes,
    algorithm: str,
    fmt: SealFormat = FMT,
    key: bytes = KEY,
    secret: bytes = SECRET,
) -> bytes:
    """What the judge says a keyed seal of ``payload`` is."""
    return judge.expected_seal(
        payload,
        secret,
        fmt.config_digest,
        fmt.layout_digest,
        key,
        fmt.page_index,
        fmt.page_count,
        algorithm,
    )


def judged(
    data: np.ndarray,
    length: int,
    secret: bytes | None,
    key: bytes = KEY,
    fmt: SealFormat = FMT,
) -> bool:
    """The judge's verdict on a page (``secret`` None: an engine without a key)."""
    return judge.verdict(
        data.tobytes(),
        secret,
        fmt.config_digest,
        fmt.layout_digest,
        key,
        fmt.page_index,
        fmt.page_count,
        length,
    )


def rewritten(data: np.ndarray, **fields: object) -> np.ndarray:
    """``data`` with seal fields changed (``"key"``, ``"config"``, ``"layout"``,
    ``"length"``, ``"index"``, ``"count"``, ``"algorithm"``, ``"key_id"``, ``"checksum"``)
    and a whole header check again: what an attacker without the key can write."""
    seal = bytearray(data[-SEAL_BYTES:].tobytes())
    spans = {
        "config": (8, "8s"),
        "layout": (16, "8s"),
        "key": (24, "8s"),
        "checksum": (32, "<Q"),
        "length": (40, "<I"),
        "index": (44, "<H"),
        "count": (46, "<H"),
        "algorithm": (48, "B"),
        "key_id": (49, "7s"),
    }
    for name, value in fields.items():
        offset, form = spans[name]
        struct.pack_into(form, seal, offset, value)
    out = data.copy()
    out[-SEAL_BYTES:] = np.frombuffer(judge.with_header_check(bytes(seal[:56])), np.uint8)
    return out


def attack_pool(
    algorithm: str, secret: bytes = SECRET, seed: int = 20
) -> tuple[np.ndarray, PageSealer, np.ndarray, np.ndarray, list[bytes]]:
    """``ATTACK_ROWS`` pages of a strided pool, each sealed by a keyed sealer in one
    batch from the checksums ``page_checksums`` computed: (pages, sealer, rows, groups,
    key digests)."""
    region = page(seed, ATTACK_ROWS * 2 * PAGE).reshape(ATTACK_ROWS, 2 * PAGE)
    pages = region[:, PAGE:]
    sealer = PageSealer(pages, FMT, ATTACK_PAYLOAD, seal_key=SealKey(secret))
    rows = np.arange(ATTACK_ROWS, dtype=np.int64)
    groups = rows % 2
    keys = [key_digest(f"chunk-{c}".encode()) for c in range(ATTACK_ROWS)]
    lengths = np.array(ATTACK_PAYLOAD)[groups]
    sums = page_checksums(pages, rows, lengths, algorithm, sealer.seal_key)
    sealer.seal_pages(rows, groups, key_rows(keys), sums, algorithm)
    return pages, sealer, rows, groups, keys


def batch_verdicts(
    sealer: PageSealer,
    rows: np.ndarray,
    groups: np.ndarray,
    keys: list[bytes] | None,
    algorithm: str,
) -> tuple[list[str | None], list[str | None], list[bool]]:
    """(header problems, header + payload problems, accepted) of a load of ``rows`` whose
    copy computed the ``algorithm`` checksums of what it moved."""
    key_array = None if keys is None else key_rows(keys)
    headers, records = sealer.header_problems(rows, groups, key_array)
    lengths = np.array(sealer.group_payload)[groups]
    sums = page_checksums(sealer.pages, rows, lengths, algorithm, sealer.seal_key)
    found = sealer.payload_problems(rows, records, list(headers), sums, algorithm)
    accepted = sealer.accepted(rows, groups, key_array, sums, algorithm).tolist()
    return list(headers), found, accepted


def assert_all(found: list[str | None], phrase: str) -> None:
    bad = [(i, f) for i, f in enumerate(found) if f is None or phrase not in f]
    assert bad == [], bad[:5]


# 8a. the sealed bytes are the judge's


@pytest.mark.parametrize("algorithm", KEYED)
@pytest.mark.parametrize("length", KEYED_LENGTHS)
def test_write_seal_keyed_is_the_judge_s_record(algorithm: str, length: int) -> None:
    seal_key = SealKey(SECRET)
    for (index, count), key in zip(PLACES * 2, KEY_DIGESTS + KEY_DIGESTS[:2], strict=True):
        fmt = SealFormat(CONFIG, LAYOUT, index, count)
        data = page(length + index)
        before = data.copy()
        write_seal(data, length, fmt, key, algorithm=algorithm, seal_key=seal_key)
        assert np.array_equal(data[: PAGE - SEAL_BYTES], before[: PAGE - SEAL_BYTES])
        expected = keyed_seal_of(before[:length].tobytes(), algorithm, fmt, key)
        assert data[PAGE - SEAL_BYTES :].tobytes() == expected, (index, count, key)
        assert seal_problem(data, fmt, key, seal_key=seal_key) is None
        assert judged(data, length, SECRET, key, fmt)

        # The universal hash given as the checksum: the same record.
        again = before.copy()
        universal = judge.universal_hash(
            before[:length].tobytes(), judge.subkeys(SECRET), algorithm
        )
        write_seal(
            again, length, fmt, key, checksum=universal, algorithm=algorithm, seal_key=seal_key
        )
        assert np.array_equal(again, data)


@pytest.mark.parametrize("algorithm", KEYED)
def test_a_keyed_seal_reads_back_as_its_fields(algorithm: str) -> None:
    data = page()
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm, seal_key=SealKey(SECRET))
    seal = read_seal(data)
    assert isinstance(seal, Seal), seal
    expected = keyed_seal_of(data[:PAYLOAD].tobytes(), algorithm)
    assert seal == Seal(
        config_digest=CONFIG,
        layout_digest=LAYOUT,
        key_digest=KEY,
        payload_bytes=PAYLOAD,
        payload_checksum=struct.unpack_from("<Q", expected, 32)[0],
        algorithm=algorithm,
        page_index=1,
        page_count=4,
        key_id=judge.subkeys(SECRET).key_id,
    )


def test_the_keyed_sealer_seals_by_the_host_s_keyed_algorithm() -> None:
    region, pages = strided_pool(30)
    before = region.copy()
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD, seal_key=SealKey(SECRET))
    sealer.seal(2, 1, KEY)
    sealer.seal(5, 0, key_digest(b"x"), algorithm="keyed_wsum64")
    expected = before.copy()
    expected[2, -SEAL_BYTES:] = np.frombuffer(
        keyed_seal_of(before[2, PAGE : PAGE + 900].tobytes(), "keyed_ghash64"), np.uint8
    )
    expected[5, -SEAL_BYTES:] = np.frombuffer(
        keyed_seal_of(before[5, PAGE : PAGE + 300].tobytes(), "keyed_wsum64", key=key_digest(b"x")),
        np.uint8,
    )
    assert np.array_equal(region, expected)
    assert sealer.problem(2, 1, KEY) is None
    assert sealer.problem(5, 0, key_digest(b"x")) is None


@pytest.mark.parametrize("algorithm", KEYED)
@pytest.mark.parametrize("place", PLACES)
def test_seal_pages_keyed_writes_the_judge_s_records(
    algorithm: str, place: tuple[int, int]
) -> None:
    fmt = SealFormat(CONFIG, LAYOUT, *place)
    group_payload = [0, 1, 3, 6, 301, 903, PAGE - SEAL_BYTES]
    region = page(31, 9 * 2 * PAGE).reshape(9, 2 * PAGE)
    pages = region[:, PAGE:]
    before = region.copy()
    sealer = PageSealer(pages, fmt, group_payload, seal_key=SealKey(SECRET))
    chunks = np.array([8, 0, 3, 5, 1, 6, 2], dtype=np.int64)
    groups = np.arange(7, dtype=np.int64)
    keys = [KEY_DIGESTS[i % 4] for i in range(7)]
    lengths = np.array(group_payload)[groups]
    sums = page_checksums(pages, chunks, lengths, algorithm, sealer.seal_key)
    sealer.seal_pages(chunks, groups, key_rows(keys), sums, algorithm)

    expected = before.copy()
    for c, g, k in zip(chunks.tolist(), groups.tolist(), keys, strict=True):
        payload = before[c, PAGE : PAGE + group_payload[g]].tobytes()
        expected[c, -SEAL_BYTES:] = np.frombuffer(
            keyed_seal_of(payload, algorithm, fmt, k), np.uint8
        )
    assert np.array_equal(region, expected)
    headers, found, accepted = batch_verdicts(sealer, chunks, groups, keys, algorithm)
    assert headers == [None] * 7 and found == [None] * 7
    assert accepted == [True] * 7


# 8b. the attacks a key stops


@pytest.mark.parametrize("forged_by", ["xxh3_64", "wsum64"])
@pytest.mark.parametrize("algorithm", KEYED)
def test_an_unkeyed_forgery_of_every_page_is_refused(algorithm: str, forged_by: str) -> None:
    """An attacker without the key replaces every page's payload and writes a valid
    unkeyed seal over it (the default algorithm, or wsum64): valid for an engine without
    a key, a forgery for the keyed one, in every path."""
    pages, sealer, rows, groups, keys = attack_pool(algorithm)
    rng = np.random.default_rng(21)
    for c, g in zip(rows.tolist(), groups.tolist(), strict=True):
        length = ATTACK_PAYLOAD[g]
        pages[c, :length] = rng.integers(0, 256, length, dtype=np.uint8)
        if forged_by == "xxh3_64":
            write_seal(pages[c], length, FMT, keys[c])  # the default: no key
        else:
            write_seal(pages[c], length, FMT, keys[c], algorithm="wsum64")

    unkeyed = PageSealer(pages, FMT, ATTACK_PAYLOAD)
    for c, g in zip(rows.tolist(), groups.tolist(), strict=True):
        assert unkeyed.problem(c, g, keys[c]) is None, c  # a valid unkeyed seal
        assert judged(pages[c], ATTACK_PAYLOAD[g], None, keys[c])
        assert not judged(pages[c], ATTACK_PAYLOAD[g], SECRET, keys[c])
        assert "forgery" in (sealer.problem(c, g, keys[c]) or ""), c
        assert "forgery" in (sealer.problem(c, g, None) or ""), c
    for given in (keys, None):
        headers, found, accepted = batch_verdicts(sealer, rows, groups, given, algorithm)
        assert_all(headers, "forgery")
        assert_all(found, "forgery")
        assert not any(accepted)


@pytest.mark.parametrize("algorithm", KEYED)
def test_changed_bytes_under_a_kept_keyed_seal_are_refused(algorithm: str) -> None:
    pages, sealer, rows, groups, keys = attack_pool(algorithm)
    rng = np.random.default_rng(22)
    for c, g in zip(rows.tolist(), groups.tolist(), strict=True):
        length = ATTACK_PAYLOAD[g]
        at = int(rng.integers(0, length))
        pages[c, at] ^= np.uint8(int(rng.integers(1, 256)))
        assert PAYLOAD_MISMATCH_TEXT in (sealer.problem(c, g, keys[c]) or ""), c
        assert not judged(pages[c], length, SECRET, keys[c])
    headers, found, accepted = batch_verdicts(sealer, rows, groups, keys, algorithm)
    assert headers == [None] * ATTACK_ROWS  # the header is whole
    assert_all(found, PAYLOAD_MISMATCH_TEXT)
    assert not any(accepted)


@pytest.mark.parametrize("algorithm", KEYED)
def test_pages_sealed_under_another_key_are_a_forgery(algorithm: str) -> None:
    pages, _, rows, groups, keys = attack_pool(algorithm, secret=OTHER_SECRET)
    sealer = PageSealer(pages, FMT, ATTACK_PAYLOAD, seal_key=SealKey(SECRET))
    for c, g in zip(rows.tolist()[:20], groups.tolist()[:20], strict=True):
        assert "forgery" in (sealer.problem(c, g, keys[c]) or ""), c
        assert "another seal key" in (sealer.problem(c, g, keys[c]) or ""), c
        assert judged(pages[c], ATTACK_PAYLOAD[g], OTHER_SECRET, keys[c])
        assert not judged(pages[c], ATTACK_PAYLOAD[g], SECRET, keys[c])
    headers, found, accepted = batch_verdicts(sealer, rows, groups, keys, algorithm)
    assert_all(headers, "forgery")
    assert_all(found, "forgery")
    assert not any(accepted)


@pytest.mark.parametrize("algorithm", KEYED)
def test_keyed_pages_are_refused_by_an_engine_without_the_key(algorithm: str) -> None:
    pages, _, rows, groups, keys = attack_pool(algorithm)
    unkeyed = PageSealer(pages, FMT, ATTACK_PAYLOAD)
    for c, g in zip(rows.tolist()[:20], groups.tolist()[:20], strict=True):
        assert "no seal key" in (unkeyed.problem(c, g, keys[c]) or ""), c
        assert "no seal key" in (seal_problem(pages[c], FMT, keys[c]) or ""), c
        assert "no seal key" in (seal_problem(pages[c], FMT, keys[c], check_payload=False) or "")
        assert not judged(pages[c], ATTACK_PAYLOAD[g], None, keys[c])
    headers, _ = unkeyed.header_problems(rows, groups, key_rows(keys))
    assert_all(list(headers), "no seal key")
    sums = page_checksums(pages, rows, np.array(ATTACK_PAYLOAD)[groups], "xxh3_64")
    assert not unkeyed.accepted(rows, groups, key_rows(keys), sums, "xxh3_64").any()


@pytest.mark.parametrize("algorithm", KEYED)
def test_the_same_key_from_the_same_bytes_accepts_every_untouched_page(algorithm: str) -> None:
    pages, _, rows, groups, keys = attack_pool(algorithm)
    again = PageSealer(pages, FMT, ATTACK_PAYLOAD, seal_key=SealKey(bytes(SECRET)))
    for c, g in zip(rows.tolist(), groups.tolist(), strict=True):
        assert again.problem(c, g, keys[c]) is None, c
        assert judged(pages[c], ATTACK_PAYLOAD[g], SECRET, keys[c]), c
    for given in (keys, None):
        headers, found, accepted = batch_verdicts(again, rows, groups, given, algorithm)
        assert headers == [None] * ATTACK_ROWS
        assert found == [None] * ATTACK_ROWS
        assert accepted == [True] * ATTACK_ROWS
    # Checksums of the other keyed algorithm: every page checked on the host, all fine.
    other = KEYED[1 - KEYED.index(algorithm)]
    before = again.host_checked_pages
    _, found, accepted = batch_verdicts(again, rows, groups, keys, other)
    assert found == [None] * ATTACK_ROWS
    assert again.host_checked_pages == before + ATTACK_ROWS
    assert not any(accepted)  # accepted compares seals by the load's algorithm only


@pytest.mark.parametrize("algorithm", KEYED)
def test_two_chunks_swapped_between_their_keys_are_refused(algorithm: str) -> None:
    """Page and seal of chunk A moved under chunk B's key and back: refused by the key
    digest; with the key digest rewritten (header check made whole), refused by the tag,
    which binds the key digest."""
    pages, sealer, _, _, keys = attack_pool(algorithm)
    a, b = 0, 2  # both of group 0
    pages[[a, b]] = pages[[b, a]]
    for chunk, wanted in ((a, keys[a]), (b, keys[b])):
        assert "another key's chunk" in (sealer.problem(chunk, 0, wanted) or "")
    original = {a: keys[b], b: keys[a]}  # what each now holds
    for chunk, wanted in ((a, keys[a]), (b, keys[b])):
        assert sealer.problem(chunk, 0, original[chunk]) is None  # whole, as the other chunk
        pages[chunk] = rewritten(pages[chunk], key=wanted)
        assert PAYLOAD_MISMATCH_TEXT in (sealer.problem(chunk, 0, wanted) or ""), chunk
        assert not judged(pages[chunk], ATTACK_PAYLOAD[0], SECRET, wanted)
    _, found, accepted = batch_verdicts(
        sealer, np.array([a, b]), np.array([0, 0]), [keys[a], keys[b]], algorithm
    )
    assert_all(found, PAYLOAD_MISMATCH_TEXT)
    assert accepted == [False, False]


@pytest.mark.parametrize("algorithm", KEYED)
def test_a_page_moved_to_another_place_or_format_is_refused(algorithm: str) -> None:
    """The tag binds the page's place in its row, both format digests, the payload
    length and the algorithm: each rewritten (header check made whole) is refused."""
    seal_key = SealKey(SECRET)
    data = page(40)
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm, seal_key=seal_key)
    assert seal_problem(data, FMT, KEY, seal_key=seal_key) is None
    moved = SealFormat(CONFIG, LAYOUT, 2, 4)
    assert "belongs" in (seal_problem(data, moved, KEY, seal_key=seal_key) or "")
    rewrites: list[tuple[SealFormat, dict[str, object]]] = [
        (moved, {"index": 2}),
        (SealFormat(CONFIG, LAYOUT, 1, 5), {"count": 5}),
        (SealFormat(b"config\x00\x02", LAYOUT, 1, 4), {"config": b"config\x00\x02"}),
        (SealFormat(CONFIG, b"layout\x00\x02", 1, 4), {"layout": b"layout\x00\x02"}),
        (FMT, {"length": PAYLOAD - 1}),
        (FMT, {"algorithm": judge.ALGORITHM_IDS[KEYED[1 - KEYED.index(algorithm)]]}),
    ]
    for fmt, fields in rewrites:
        forged = rewritten(data, **fields)
        assert isinstance(read_seal(forged), Seal), fields  # a whole header
        found = seal_problem(forged, fmt, KEY, seal_key=seal_key)
        assert found is not None and PAYLOAD_MISMATCH_TEXT in found, (fields, found)
        length = PAYLOAD - 1 if "length" in fields else PAYLOAD
        assert not judged(forged, length, SECRET, KEY, fmt), fields
    # The page's own place and key, in a sealer of that place: accepted, moved: refused.
    pool = np.stack([data, data])
    assert PageSealer(pool, FMT, [PAYLOAD], seal_key=seal_key).problem(0, 0, KEY) is None
    assert "belongs" in (
        PageSealer(pool, moved, [PAYLOAD], seal_key=seal_key).problem(0, 0, KEY) or ""
    )


@pytest.mark.parametrize("algorithm", KEYED)
def test_a_keyed_looking_forgery_with_the_key_id_copied_is_refused(algorithm: str) -> None:
    """An attacker copies a keyed seal's key id (it is public) onto new bytes and guesses
    a tag: the header is whole and names the key, the tag is wrong."""
    seal_key = SealKey(SECRET)
    data = page(41)
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm, seal_key=seal_key)
    data[:PAYLOAD] = page(42)[:PAYLOAD]
    for guess in (
        xxhash.xxh3_64_intdigest(data[:PAYLOAD].tobytes()),
        wsum64(data[:PAYLOAD].tobytes()),
        0,
    ):
        forged = rewritten(data, checksum=guess)
        assert PAYLOAD_MISMATCH_TEXT in (seal_problem(forged, FMT, KEY, seal_key=seal_key) or "")
        assert not judged(forged, PAYLOAD, SECRET)


# 8c. properties of the tag


@pytest.mark.parametrize("algorithm", KEYED)
def test_every_sampled_single_bit_flip_of_the_payload_is_refused(algorithm: str) -> None:
    seal_key = SealKey(SECRET)
    data = page(43)
    write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm, seal_key=seal_key)
    assert judged(data, PAYLOAD, SECRET)
    bits = np.random.default_rng(44).choice(PAYLOAD * 8, size=64, replace=False).tolist()
    bits[:3] = [0, PAYLOAD * 8 - 1, 8 * (PAYLOAD // 2) + 7]  # both ends and a high bit
    for bit in bits:
        data[bit // 8] ^= np.uint8(1 << (bit % 8))
        found = seal_problem(data, FMT, KEY, seal_key=seal_key)
        assert found is not None and PAYLOAD_MISMATCH_TEXT in found, bit
        assert not judged(data, PAYLOAD, SECRET), bit
        data[bit // 8] ^= np.uint8(1 << (bit % 8))
    assert seal_problem(data, FMT, KEY, seal_key=seal_key) is None


@pytest.mark.parametrize("algorithm", KEYED)
def test_any_changed_keyed_seal_byte_is_refused(algorithm: str) -> None:
    _, pages = strided_pool(45)
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD, seal_key=SealKey(SECRET))
    rows, groups = np.array([2, 5], dtype=np.int64), np.array([0, 1], dtype=np.int64)
    keys = [key_digest(b"x"), key_digest(b"y")]
    sums = page_checksums(pages, rows, np.array(GROUP_PAYLOAD), algorithm, sealer.seal_key)
    sealer.seal_pages(rows, groups, key_rows(keys), sums, algorithm)
    sealed_page = pages[5].copy()
    for offset in range(SEAL_BYTES):
        pages[5] = sealed_page
        pages[5, PAGE - SEAL_BYTES + offset] ^= 0x10
        assert sealer.accepted(rows, groups, key_rows(keys), sums, algorithm).tolist() == [
            True,
            False,
        ], offset
        assert sealer.problem(5, 1, keys[1]) is not None, offset


def test_the_universal_hash_is_never_stored() -> None:
    """The checksum field holds the tag, not the payload's universal hash."""
    seal_key = SealKey(SECRET)
    keys = judge.subkeys(SECRET)
    for algorithm in KEYED:
        data = page(46)
        write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm, seal_key=seal_key)
        stored = data[-SEAL_BYTES:].tobytes()
        universal = judge.universal_hash(data[:PAYLOAD].tobytes(), keys, algorithm)
        assert struct.pack("<Q", universal) not in stored
        assert struct.pack(">Q", universal) not in stored


# 8d. the counters' reason


def test_the_counters_name_keyed_refusals() -> None:
    pytest.importorskip("vllm")
    from triton_offload.vllm.counters import refusal_reason

    seal_key = SealKey(SECRET)
    data = page(47)
    write_seal(data, PAYLOAD, FMT, KEY, algorithm="keyed_ghash64", seal_key=seal_key)
    other = page(47)
    write_seal(other, PAYLOAD, FMT, KEY, algorithm="keyed_ghash64", seal_key=SealKey(OTHER_SECRET))
    unkeyed = page(47)
    write_seal(unkeyed, PAYLOAD, FMT, KEY)
    changed = data.copy()
    changed[0] ^= 1

    def problem(page_: np.ndarray, key: SealKey | None) -> str:
        found = seal_problem(page_, FMT, KEY, seal_key=key)
        assert found is not None
        return found

    assert refusal_reason(problem(unkeyed, seal_key)) == "forgery"
    assert refusal_reason(problem(other, seal_key)) == "forgery"
    assert refusal_reason(problem(data, None)) == "keyed"
    assert refusal_reason(problem(changed, seal_key)) == "checksum"


# 8e. keyed arguments


def test_keyed_algorithms_need_the_key_and_a_key_needs_them() -> None:
    data = page()
    for algorithm in KEYED:
        with pytest.raises(ValueError, match="seal key"):
            write_seal(data, PAYLOAD, FMT, KEY, algorithm=algorithm)
        with pytest.raises(ValueError, match="seal key"):
            page_checksum(data[:PAYLOAD], algorithm)
        with pytest.raises(ValueError, match="seal key"):
            page_checksums(data.reshape(1, -1), np.array([0]), np.array([PAYLOAD]), algorithm)
    with pytest.raises(TypeError, match="SealKey"):
        PageSealer(np.zeros((2, PAGE), np.uint8), FMT, [10], seal_key=SECRET)  # type: ignore[arg-type]
    _, pages = strided_pool()
    keyed = PageSealer(pages, FMT, GROUP_PAYLOAD, seal_key=SealKey(SECRET))
    unkeyed = PageSealer(pages, FMT, GROUP_PAYLOAD)
    one = (np.array([0]), np.array([0]), key_rows([KEY]), np.array([1], np.uint64))
    with pytest.raises(ValueError, match="keyed sealer"):
        keyed.seal_pages(*one, "xxh3_64")
    with pytest.raises(ValueError, match="keyed sealer"):
        unkeyed.seal_pages(*one, "keyed_ghash64")


@pytest.mark.parametrize("algorithm", ["xxh3_64", "wsum64"])
def test_a_keyed_sealer_never_writes_a_seal_it_refuses(algorithm: str) -> None:
    """``PageSealer``: "With a key, pages are sealed with its tags and only its seals are
    accepted"; ``seal_pages`` refuses an unkeyed algorithm (ValueError). ``seal`` must
    too, or seal with the key: a page a keyed sealer seals is one it accepts."""
    _, pages = strided_pool(48)
    sealer = PageSealer(pages, FMT, GROUP_PAYLOAD, seal_key=SealKey(SECRET))
    try:
        sealer.seal(1, 0, KEY, algorithm=algorithm)
    except ValueError:
        return
    assert sealer.problem(1, 0, KEY) is None, read_seal(pages[1])
