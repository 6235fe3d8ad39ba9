"""Page checksums computed by the copy kernel (wsum64), against the numpy judge.

Run under TRITON_INTERPRET=1 on CPU tensors (the ``device`` fixture; on a GPU without
the interpreter they run compiled, with real atomics). Every copying case checks the copy
byte-exactly as tests/kernels/test_copy_blocks.py does (source unchanged, addressed destination
bytes equal, unaddressed ones still poison) and that ``page_sums`` read as uint64 equals
the judge's wsum64 of each pool row with every byte no pair addresses zeroed, i.e. the
sum over exactly the moved bytes. The ``write=False`` pass must change nothing and give
the sums of the copying pass.

The layouts (``tests/helpers/copy_case.py``) mix the kernel's paths: pages of 270 and
1,540 bytes whose slots sit at row offsets 0, 4 and 8 mod 16 and odd ones, fragment
planes (slot stride > page), pools at odd addresses or with odd row strides, tiles cut
small so pages span several items.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_offload.kernels.copy_blocks import TILE_BYTES, WSUM_MULTIPLIER

from tests.helpers.checksum_judge import MULTIPLIER, weights, wsum64, wsum64_words
from tests.helpers.copy_case import (
    POOL_ROWS,
    U64,
    Case,
    PlaneSpec,
    check_copy,
    job,
    launch,
    page_of_row,
)
from triton_offload.transfer.jobs import Direction

DIRECTIONS = [Direction.TO_POOL, Direction.FROM_POOL]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("pool_shift", "row_gap", "tile_bytes", "num_programs"),
    [
        (0, 0, 64, None),  # aligned rows: 16-, 8-, 4-byte and byte paths by slot
        (1, 3, 256, 3),  # odd pool: the byte path everywhere
        (4, 0, 128, 1),  # 4-byte aligned pool: the 4-byte path where slots allow
        (8, 8, TILE_BYTES, 5),  # 8-byte aligned pool, whole pages in one tile
        (0, 36, 32, 2),  # rows 4 mod 16 apart: paths alternate between rows
    ],
)
def test_copy_with_page_sums_is_exact_and_sums_the_moved_bytes(
    device: torch.device,
    direction: Direction,
    pool_shift: int,
    row_gap: int,
    tile_bytes: int,
    num_programs: int | None,
) -> None:
    case = Case(device, pool_shift, row_gap, tile_bytes)
    seed = pool_shift * 10 + row_gap + int(direction)
    pairs, offsets = job(seed)
    case.fill(seed)
    before = case.snapshot()
    expected = case.expected_copy(pairs, offsets, direction)
    masks = case.masks(pairs, offsets)

    sums = launch(
        case, pairs, offsets, direction, pages=page_of_row(seed), num_programs=num_programs
    )

    check_copy(case, before, expected, masks, direction)
    # Store: the bytes written to the pool; load: the pool bytes read (the pool after the
    # copy holds both).
    want = case.row_sums(case.snapshot()[-1], masks[-1])
    assert sums == want
    assert sum(1 for s in want if s) == 4  # 2 chunks of group 0, 2 of group 1


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_page_offset_not_word_aligned_at_16_byte_aligned_addresses(
    device: torch.device, direction: Direction
) -> None:
    # Slot 1 of a 270-byte page starts 270 = 2 mod 4 bytes into its row; rows at 2 mod
    # 16 put it at a 16-byte aligned address, as are the cache blocks. Addresses alone
    # would send it down the 16-byte path with wrong word indices; the page offset sends
    # it to the byte path.
    planes = (PlaneSpec(0, 270, 0, backing=0, lead=0, block_stride=272),)
    case = Case(device, 2, 0, 64, planes=planes, num_groups=1)
    assert (case.pool[0].data_ptr() + 270) % 16 == 0
    assert case.backings[0].data_ptr() % 16 == 0
    pairs, offsets = job(13, counts=(5,))
    case.fill(13)
    before = case.snapshot()
    expected = case.expected_copy(pairs, offsets, direction)
    masks = case.masks(pairs, offsets)
    sums = launch(case, pairs, offsets, direction, pages=page_of_row(13))
    check_copy(case, before, expected, masks, direction)
    assert sums == case.row_sums(case.snapshot()[-1], masks[-1])


def test_store_into_zeroed_rows_sums_the_whole_row(device: torch.device) -> None:
    # Linearity: bytes nobody moves count as zero, so into a zeroed pool the page sum is
    # the judge's wsum64 of the whole row.
    case = Case(device, 0, 0, 64)
    pairs, offsets = job(7)
    case.fill(7)
    case.pool_buffer.zero_()
    sums = launch(case, pairs, offsets, Direction.TO_POOL, pages=page_of_row(7))
    pool = case.snapshot()[-1].numpy()
    rows = [pool[r * case.row_stride :][: case.row_bytes] for r in range(POOL_ROWS)]
    assert sums == [wsum64(row) for row in rows]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_read_only_pass_changes_nothing_and_gives_the_copys_sums(
    device: torch.device, direction: Direction
) -> None:
    # Direction 0 reads the GPU blocks (the DMA path's check), 1 the pool rows; the sums
    # are weighted by pool offsets either way, so they match the copying pass's.
    case = Case(device, 0, 36, 64)
    pairs, offsets = job(11)
    case.fill(11)
    pages = page_of_row(11)
    before = case.snapshot()

    read_only = launch(case, pairs, offsets, direction, pages=pages, write=False, num_programs=3)

    for index, (old, now) in enumerate(zip(before, case.snapshot(), strict=True)):
        assert torch.equal(old, now), f"tensor {index} changed by a write=False pass"
    copied = launch(case, pairs, offsets, direction, pages=pages)
    assert read_only == copied
    assert read_only == case.row_sums(case.snapshot()[-1], case.masks(pairs, offsets)[-1])


def test_checksum_off_copy_matches_checksum_on_copy(device: torch.device) -> None:
    # The same job with and without page sums moves the same bytes.
    results = []
    for pages in (None, page_of_row(5)):
        case = Case(device, 1, 3, 64)
        pairs, offsets = job(5)
        case.fill(5)
        launch(case, pairs, offsets, Direction.TO_POOL, pages=pages)
        results.append(case.snapshot()[-1])
    assert torch.equal(results[0], results[1])


# --- the judge itself --------------------------------------------------------------


def test_judge_on_hand_computed_pages() -> None:
    c = 0x9E3779B1
    assert MULTIPLIER == WSUM_MULTIPLIER == c
    assert [int(w) for w in weights(np.arange(3))] == [c, (3 * c) % 2**32, (5 * c) % 2**32]
    assert wsum64(np.array([1, 0, 0, 0, 0], dtype=np.uint8)) == c
    assert wsum64(np.array([0, 0, 0, 0, 1], dtype=np.uint8)) == (3 * c) % 2**32
    assert wsum64(np.array([0, 0, 0, 0xFF], dtype=np.uint8)) == (0xFF << 24) * c
    # Two all-ones words: (2**32 - 1) * (h(0) + h(1)), wrapped to 64 bits.
    ones = np.full(8, 0xFF, dtype=np.uint8)
    assert wsum64(ones) == ((2**32 - 1) * (c + (3 * c) % 2**32)) % U64
    assert wsum64(np.zeros(0, dtype=np.uint8)) == 0


@pytest.mark.parametrize("size", [1, 3, 4, 270, 1540, 4099])
def test_judge_byte_and_word_forms_agree(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert wsum64(data) == wsum64_words(data)


def test_one_flipped_bit_or_two_swapped_words_change_the_sum() -> None:
    # Exhaustive over a 64-byte page: a flip changes one word by +-2**k, i.e. the sum by
    # +-2**k * h(j) (odd h: never 0 mod 2**64); a swap of words i, j changes it by
    # (w_i - w_j) * (h_j - h_i), both factors nonzero and below 2**32 in size.
    page = np.random.default_rng(3).integers(0, 256, 64, dtype=np.uint8)
    page[8:12] = page[20:24]  # one pair of equal words (swapping those changes nothing)
    base = wsum64(page)
    for bit in range(page.size * 8):
        flipped = page.copy()
        flipped[bit // 8] ^= np.uint8(1 << (bit % 8))
        assert wsum64(flipped) != base, f"bit {bit}"
    words = page.view("<u4")
    for i in range(words.size):
        for j in range(i + 1, words.size):
            swapped = words.copy()
            swapped[[i, j]] = swapped[[j, i]]
            if words[i] == words[j]:
                assert wsum64(swapped.view(np.uint8)) == base
            else:
                assert wsum64(swapped.view(np.uint8)) != base, f"words {i}, {j}"
