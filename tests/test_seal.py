"""The chunk seal, judged from its format (not from the code that writes it).

The format (README "Verified chunks"): the last 64 bytes of a page are
``magic(8) config(8) layout(8) key(8) length(u32) crc32(u32) index(u16) count(u16)
zero(16) seal_crc32(u32)``, little-endian, ``crc32`` = zlib's CRC-32 of the first
``length`` bytes of the page, ``seal_crc32`` = CRC-32 of the 60 bytes before it.
"""

from __future__ import annotations

import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from triton_offload.transfer.seal import (
    SEAL_BYTES,
    PageSealer,
    SealFormat,
    digest8,
    key_digest,
    layout_description,
    seal_problem,
    write_seal,
)

PAGE = 1024
FMT = SealFormat(digest8("config"), digest8("layout"), 1, 4)
KEY = key_digest(b"chunk-key")


def page(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def expected_record(payload: bytes, length: int, fmt: SealFormat, key: bytes) -> bytes:
    fields = (
        b"TOSEAL\x00\x01"
        + fmt.config_digest
        + fmt.layout_digest
        + key
        + struct.pack("<IIHH", length, zlib.crc32(payload[:length]), fmt.page_index, fmt.page_count)
        + bytes(16)
    )
    return fields + struct.pack("<I", zlib.crc32(fields))


def test_the_seal_is_the_documented_record_and_touches_nothing_else() -> None:
    data = page()
    before = data.copy()
    write_seal(data, 700, FMT, KEY)
    assert np.array_equal(data[: PAGE - SEAL_BYTES], before[: PAGE - SEAL_BYTES])
    assert data[PAGE - SEAL_BYTES :].tobytes() == expected_record(before.tobytes(), 700, FMT, KEY)
    assert seal_problem(data, FMT, KEY) is None
    assert seal_problem(data, FMT, None) is None  # no key given: the key is not checked


@pytest.mark.parametrize("offset", [0, 1, 350, 699])
def test_any_flipped_payload_byte_is_refused(offset: int) -> None:
    data = page()
    write_seal(data, 700, FMT, KEY)
    data[offset] ^= 0x01
    assert "payload checksum" in (seal_problem(data, FMT, KEY) or "")


def test_bytes_after_the_payload_are_not_covered() -> None:
    """Only what the store wrote is covered: padding between payload and seal may hold
    anything (a group with a shorter row leaves the rest of the page untouched)."""
    data = page()
    write_seal(data, 700, FMT, KEY)
    data[800] ^= 0xFF
    assert seal_problem(data, FMT, KEY) is None


@pytest.mark.parametrize("offset", range(0, 60, 7))
def test_a_damaged_record_is_told_apart(offset: int) -> None:
    data = page()
    write_seal(data, 700, FMT, KEY)
    data[PAGE - SEAL_BYTES + offset] ^= 0x10
    problem = seal_problem(data, FMT, KEY) or ""
    assert "damaged seal" in problem or "magic" in problem


def test_what_else_a_page_can_be() -> None:
    data = page()
    write_seal(data, 700, FMT, KEY)
    assert "another key" in (seal_problem(data, FMT, key_digest(b"other")) or "")
    other_layout = SealFormat(FMT.config_digest, digest8("fused"), 1, 4)
    assert "row layout" in (seal_problem(data, other_layout, KEY) or "")
    # The scheduler checks a promoted page without the layout digest.
    assert seal_problem(data, other_layout, KEY, check_layout=False) is None
    other_config = SealFormat(digest8("tp2"), FMT.layout_digest, 1, 4)
    assert "configuration" in (seal_problem(data, other_config, KEY) or "")
    other_page = SealFormat(FMT.config_digest, FMT.layout_digest, 2, 4)
    assert "page 1 of 4" in (seal_problem(data, other_page, KEY) or "")
    assert "payload of 700" in (seal_problem(data, FMT, KEY, expected_payload=512) or "")
    zeros = np.zeros(PAGE, dtype=np.uint8)
    assert "no seal" in (seal_problem(zeros, FMT, KEY) or "")
    assert "no seal" in (seal_problem(page(5), FMT, KEY) or "")  # garbage


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="payload_bytes 961"):
        write_seal(page(), PAGE - SEAL_BYTES + 1, FMT, KEY)
    with pytest.raises(TypeError, match="1-D uint8"):
        write_seal(np.zeros(PAGE, dtype=np.int8), 10, FMT, KEY)
    with pytest.raises(ValueError, match="page 4 of 4"):
        SealFormat(FMT.config_digest, FMT.layout_digest, 4, 4)
    with pytest.raises(ValueError, match="config_digest must be 8 bytes"):
        SealFormat(b"short", FMT.layout_digest, 0, 1)
    with pytest.raises(ValueError, match="group 1's 1000-byte row"):
        PageSealer(np.zeros((2, PAGE), dtype=np.uint8), FMT, [10, 1000])


def test_the_sealer_seals_rows_of_a_strided_pool() -> None:
    region = np.random.default_rng(1).integers(0, 256, (3, 2 * PAGE), dtype=np.uint8)
    pages = region[:, PAGE:]  # the second worker's pages: rows 2 pages apart
    before = region.copy()
    sealer = PageSealer(pages, FMT, [300, 900])
    sealer.seal(2, 1, KEY)
    changed = np.argwhere(region != before)
    assert {int(r) for r, _ in changed} == {2}
    assert all(int(c) >= 2 * PAGE - SEAL_BYTES for _, c in changed)
    assert sealer.problem(2, 1, KEY) is None
    assert "payload of 900" in (sealer.problem(2, 0, KEY) or "")
    assert "no seal" in (sealer.problem(0, 0, KEY) or "") or "magic" in (
        sealer.problem(0, 0, KEY) or ""
    )


def test_split_and_fused_planes_of_the_same_bytes_have_different_layouts() -> None:
    def plane(offset: int, page: int) -> SimpleNamespace:
        return SimpleNamespace(group=0, pool_offset=offset, page_bytes=page)

    split = layout_description([plane(0, 512), plane(1024, 512)], 2)  # type: ignore[list-item]
    fused = layout_description([plane(0, 1024)], 2)  # type: ignore[list-item]
    assert split != fused
    assert digest8(split) != digest8(fused)
