"""Keyed page sums (keyed_wsum64) computed by the copy kernel, against a numpy judge.

``keyed_wsum64`` of a page is the sum over its little-endian 32-bit words ``w_j`` (the
last one zero-padded) of ``w_j * r_j`` mod 2**64, ``r_j`` the j-th weight of the table
(int64, read as uint64). The judge here is written from that definition alone, in two
forms (numpy's wrapping uint64 dot over words, and Python integers over bytes) that must
agree; nothing of the kernel or of ``transfer.seal_key`` is used.

Run under TRITON_INTERPRET=1 on CPU tensors (the ``device`` fixture; on a GPU without the
interpreter they run compiled). Every copying case checks the copy byte-exactly (source
unchanged, addressed destination bytes equal, unaddressed ones still poison) and that
``page_sums`` equals the judge's keyed_wsum64 of each pool row with every byte no pair
addresses zeroed. Tables are exactly as long as the longest payload's words, so a lane
weighed past the payload would read past the table: a subprocess checks that with the
table's end against an unreadable memory page.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from triton_offload.kernels import copy_blocks
from triton_offload.kernels.copy_blocks import TILE_BYTES

from tests.helpers.checksum_judge import wsum64
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
from triton_offload.transfer.checksums import job_pages
from triton_offload.transfer.copiers import JobHolds, PageSums, TritonCopier
from triton_offload.transfer.jobs import Direction, PairTable

DIRECTIONS = [Direction.TO_POOL, Direction.FROM_POOL]
ROOT = Path(__file__).resolve().parents[2]

# One group whose payload ends mid-word and holds a gap: a 1,540-byte page with slots at
# row offsets 0, 4 and 8 mod 16 (16-, 4- and 8-byte paths where addresses allow), then,
# after 4 bytes of padding (4,620..4,624), a 270-byte page at 4,624 (0 mod 16), 4,894
# (2 mod 4: byte path) and 5,164 (12 mod 16: the 4-byte path in rows at 0 mod 16, the
# 16-byte one in rows at 4 mod 16); its blocks are 16-byte aligned. The payload is 5,434
# bytes: 1,358 words and a half, so its table holds 1,359 weights, and the row's last
# item masks lanes whose words lie past the table on every path.
TAIL_PLANES = (
    PlaneSpec(0, 1540, 0, backing=0, lead=0, block_stride=1552),
    PlaneSpec(0, 270, 4624, backing=1, lead=0, block_stride=272),
)
TAIL_PAYLOAD = 5434

# (pool_shift, row_gap, tile_bytes, num_programs). Which access paths each job takes
# depends on its rows; test_the_cases_take_every_path checks that every path is taken
# in each direction (and by the first case alone).
CONFIGS = [
    (0, 0, 64, None),  # aligned rows: 16-, 8-, 4-byte and byte paths by slot
    (1, 3, 256, 3),  # odd pool, rows 3 bytes apart: mostly the byte path
    (4, 0, 128, 1),  # 4-byte aligned pool: 8- and 4-byte paths where slots allow
    (8, 8, TILE_BYTES, 5),  # 8-byte aligned pool, whole pages in one tile
    (0, 36, 32, 2),  # rows 4 mod 16 apart: paths alternate between rows
]
ALL_PATHS = {16, 8, 4, 1}


def config_seed(config: tuple[int, int, int, int | None], direction: Direction) -> int:
    return 1000 + config[0] * 10 + config[1] + int(direction)


# --- the judge ---------------------------------------------------------------------


def keyed_wsum64(page_bytes: np.ndarray, weights: np.ndarray) -> int:
    """keyed_wsum64 of a page (uint8; offset 0 is the page's first byte) under
    ``weights`` (int64, uint64 bits). Bytes past the table's words must be zero (no
    weight exists for them: a page never holds any)."""
    data = np.ascontiguousarray(page_bytes, dtype=np.uint8).reshape(-1)
    covered = 4 * weights.size
    assert not data[covered:].any(), "nonzero bytes past the weights table"
    data = data[:covered]
    padded = np.zeros(-(-data.size // 4) * 4, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view("<u4").astype(np.uint64)
    r = np.ascontiguousarray(weights[: words.size]).view(np.uint64)
    return int(np.dot(words, r))  # integer dot: wraps mod 2**64


def keyed_wsum64_bytes(page_bytes: np.ndarray, weights: np.ndarray) -> int:
    """The byte form, in Python integers: the byte ``b`` at offset ``o`` adds
    ``b * 2**(8 * (o % 4)) * r_(o // 4)``."""
    r = [int(w) % U64 for w in weights.tolist()]
    total = 0
    for offset, value in enumerate(np.asarray(page_bytes, dtype=np.uint8).tolist()):
        if value:
            total += (value << (8 * (offset % 4))) * r[offset // 4]
    return total % U64


def random_weights(words: int, seed: int) -> np.ndarray:
    """``words`` random uint64 weights as int64 (about half of them negative)."""
    generator = np.random.default_rng(seed)
    return generator.integers(0, 2**64, words, dtype=np.uint64, endpoint=False).view(np.int64)


def table_words(case: Case) -> int:
    """Weights the case's table needs: the longest group payload's words, rounded up."""
    return -(-max(case.layout.group_row_bytes) // 4)


def keyed_row_sums(
    case: Case, pool_buffer: torch.Tensor, pool_mask: torch.Tensor, weights: np.ndarray
) -> list[int]:
    return [keyed_wsum64(row, weights) for row in case.rows(pool_buffer, pool_mask)]


def item_paths(
    case: Case, pairs: torch.Tensor, offsets: torch.Tensor, first_offset: int = 0
) -> set[int]:
    """The access widths the kernel's items take for this job, from the kernel's rule
    (with page sums): the widest of 16/8/4 bytes dividing both addresses and, for the
    word indices, the page offset's 4-byte alignment; 1 for a byte tail or a misaligned
    item. Only the tiles at slot-0 offsets from ``first_offset`` on (default: all). A
    coverage check of the cases, not a judge of sums."""
    tiles = case.tables.tile_table.cpu().tolist()
    groups = case.tables.group_table.cpu().tolist()
    paths = set()
    for group, (count, first) in enumerate(groups):
        for block, row, slot in pairs[int(offsets[group]) : int(offsets[group + 1])].tolist():
            for address0, stride, tile_offset, slot_stride, length in tiles[first:][:count]:
                if tile_offset < first_offset:
                    continue
                page_offset = tile_offset + slot * slot_stride
                pool = case.pool.data_ptr() + row * case.row_stride + page_offset
                alignment = (address0 + block * stride) | pool | (page_offset & 3)
                word = next((w for w in (16, 8, 4) if alignment % w == 0), 1)
                if word > 1 and length >= word:
                    paths.add(word)
                if word == 1 or length % word:
                    paths.add(1)
    return paths


def test_judge_on_hand_computed_pages() -> None:
    weights = np.array([3, -1, 1 << 40], dtype=np.int64)  # -1: the weight 2**64 - 1
    assert keyed_wsum64(np.array([1, 0, 0, 0], dtype=np.uint8), weights) == 3
    assert keyed_wsum64(np.array([0, 0, 0, 0, 2], dtype=np.uint8), weights) == U64 - 2
    assert keyed_wsum64(np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], dtype=np.uint8), weights) == (
        1 << 48
    )
    # A whole word times a large weight wraps: 0xFFFFFFFF * (2**64 - 1) = -0xFFFFFFFF.
    ones = np.array([0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF], dtype=np.uint8)
    assert keyed_wsum64(ones, weights) == U64 - 0xFFFF_FFFF
    assert keyed_wsum64(np.zeros(0, dtype=np.uint8), weights) == 0
    with pytest.raises(AssertionError, match="past the weights table"):
        keyed_wsum64(np.ones(13, dtype=np.uint8), weights)


@pytest.mark.parametrize("size", [1, 3, 4, 270, 1541])
def test_judge_word_and_byte_forms_agree(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    weights = random_weights(-(-size // 4), size)
    assert keyed_wsum64(data, weights) == keyed_wsum64_bytes(data, weights)


# --- the kernel --------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_the_cases_take_every_path(device: torch.device, direction: Direction) -> None:
    taken = []
    for config in CONFIGS:
        case = Case(device, *config[:3])
        taken.append(item_paths(case, *job(config_seed(config, direction))))
    assert taken[0] == ALL_PATHS
    assert set().union(*taken) == ALL_PATHS
    assert all(1 in paths for paths in taken)  # every case has byte items or tails


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("config", CONFIGS)
def test_keyed_copy_is_exact_and_sums_the_moved_bytes(
    device: torch.device, direction: Direction, config: tuple[int, int, int, int | None]
) -> None:
    pool_shift, row_gap, tile_bytes, num_programs = config
    case = Case(device, pool_shift, row_gap, tile_bytes)
    seed = config_seed(config, direction)
    pairs, offsets = job(seed)
    case.fill(seed)
    weights = random_weights(table_words(case), seed)
    before = case.snapshot()
    expected = case.expected_copy(pairs, offsets, direction)
    masks = case.masks(pairs, offsets)

    sums = launch(
        case,
        pairs,
        offsets,
        direction,
        pages=page_of_row(seed),
        num_programs=num_programs,
        page_weights=torch.from_numpy(weights.copy()).to(device),
    )

    check_copy(case, before, expected, masks, direction)
    # Store: the bytes written to the pool; load: the pool bytes read (the pool after the
    # copy holds both).
    pool, pool_mask = case.snapshot()[-1], masks[-1]
    want = keyed_row_sums(case, pool, pool_mask, weights)
    assert sums == want
    assert sum(1 for s in want if s) == 4  # 2 chunks of group 0, 2 of group 1
    # The key matters: the unkeyed sums of the same bytes differ on every page summed.
    unkeyed = case.row_sums(pool, pool_mask)
    assert all(k != u for k, u in zip(want, unkeyed, strict=True) if u)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_keyed_read_only_pass_changes_nothing_and_gives_the_copys_sums(
    device: torch.device, direction: Direction
) -> None:
    case = Case(device, 0, 36, 64)
    pairs, offsets = job(21)
    case.fill(21)
    pages = page_of_row(21)
    weights = torch.from_numpy(random_weights(table_words(case), 21).copy()).to(device)
    before = case.snapshot()

    read_only = launch(
        case,
        pairs,
        offsets,
        direction,
        pages=pages,
        write=False,
        num_programs=3,
        page_weights=weights,
    )

    for index, (old, now) in enumerate(zip(before, case.snapshot(), strict=True)):
        assert torch.equal(old, now), f"tensor {index} changed by a write=False pass"
    copied = launch(case, pairs, offsets, direction, pages=pages, page_weights=weights)
    assert read_only == copied
    want = keyed_row_sums(
        case, case.snapshot()[-1], case.masks(pairs, offsets)[-1], weights.cpu().numpy()
    )
    assert read_only == want


def test_keyed_and_unkeyed_launches_move_the_same_bytes_and_differ_in_sums(
    device: torch.device,
) -> None:
    results = []
    for keyed in (False, True):
        case = Case(device, 1, 3, 64)
        pairs, offsets = job(5)
        case.fill(5)
        weights = torch.from_numpy(random_weights(table_words(case), 5).copy()).to(device)
        sums = launch(
            case,
            pairs,
            offsets,
            Direction.TO_POOL,
            pages=page_of_row(5),
            page_weights=weights if keyed else None,
        )
        assert sums is not None
        results.append((case.snapshot()[-1], sums))
    (plain_pool, plain_sums), (keyed_pool, keyed_sums) = results
    assert torch.equal(plain_pool, keyed_pool)
    summed = [row for row in range(POOL_ROWS) if plain_sums[row]]
    assert len(summed) == 4
    assert all(plain_sums[row] != keyed_sums[row] for row in summed)
    assert all(keyed_sums[row] == 0 for row in range(POOL_ROWS) if row not in summed)


def test_warm_up_with_keyed_does_nothing_on_cpu() -> None:
    # The CPU (interpreted) kernels compile nothing; the keyed variants bind on CUDA only
    # (test_copy_blocks_ptx.py compiles them for sm_80 and sm_90).
    copy_blocks.warm_up("cpu", checksum=True, keyed=True)


# --- through the copier: whole pages (moved slots, the rest, the gaps) --------------


def summed_job(
    copier: TritonCopier,
    table: PairTable,
    direction: Direction,
    page_sums: torch.Tensor,
) -> np.ndarray:
    """Run a checksummed job as the engine does on the kernel path: the copy with page
    sums, a read-only pass over the slots of its pages it does not move, one over the
    bytes between slots. Returns the job's rows (page ``i`` is ``rows[i]``)."""
    pages = job_pages(copier.layout, table)
    holds = JobHolds()
    runs = [
        copier.prepare(
            table, int(direction), None, holds, None, sums=PageSums(page_sums, pages.pair_pages)
        )
    ]
    if pages.rest.pairs.shape[0]:
        rest = PageSums(page_sums, pages.rest_pages, write=False)
        runs.append(
            copier.prepare(pages.rest, int(Direction.FROM_POOL), None, holds, None, sums=rest)
        )
    gaps = copier.prepare_gaps(
        pages.whole, holds, None, PageSums(page_sums, pages.whole_pages, write=False)
    )
    assert gaps is not None, "the layout has bytes between slots"
    runs.append(gaps)
    for run in runs:
        run()
    return pages.rows


@pytest.mark.parametrize(("pool_shift", "row_gap", "tile_bytes"), [(0, 0, 64), (4, 4, 128)])
def test_copier_sums_whole_pages_keyed(
    device: torch.device, pool_shift: int, row_gap: int, tile_bytes: int
) -> None:
    # A store then a load of the same pages: each page's sum is the judge's keyed sum
    # of its whole payload (including the slot the job leaves out, the 4-byte gap and
    # the half word at the end), whatever bytes sit in the pool beyond it.
    case = Case(device, pool_shift, row_gap, tile_bytes, planes=TAIL_PLANES, num_groups=1)
    assert case.layout.group_row_bytes == (TAIL_PAYLOAD,)
    assert table_words(case) == -(-TAIL_PAYLOAD // 4)
    pairs, offsets = job(31, counts=(5,))  # chunk A: slots 1, 2 (slot 0 is the rest)
    assert item_paths(case, pairs, offsets) == ALL_PATHS
    case.fill(31)
    weights = random_weights(table_words(case), 31)
    copier = TritonCopier(
        case.layout,
        case.pool.data_ptr(),
        case.row_stride,
        device=device,
        cuda=device.type == "cuda",
        num_programs=3,
        tile_bytes=tile_bytes,
    )
    copier.set_page_weights(torch.from_numpy(weights.copy()).to(device))
    table = PairTable(pairs.numpy(), offsets.numpy())
    before = case.snapshot()
    expected = case.expected_copy(pairs, offsets, Direction.TO_POOL)
    masks = case.masks(pairs, offsets)

    store_sums = torch.zeros(2, dtype=torch.int64, device=device)
    rows = summed_job(copier, table, Direction.TO_POOL, store_sums)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    check_copy(case, before, expected, masks, Direction.TO_POOL)
    pool = case.snapshot()[-1].numpy()
    payloads = [pool[pool_shift + int(row) * case.row_stride :][:TAIL_PAYLOAD] for row in rows]
    want = [keyed_wsum64(payload, weights) for payload in payloads]
    assert [int(s) % U64 for s in store_sums.cpu().tolist()] == want
    assert all(k != wsum64(p) for k, p in zip(want, payloads, strict=True))

    # The load reads the same pages back: the same sums.
    load_sums = torch.zeros(2, dtype=torch.int64, device=device)
    summed_job(copier, table, Direction.FROM_POOL, load_sums)
    assert [int(s) % U64 for s in load_sums.cpu().tolist()] == want


# --- no weight read past the table ---------------------------------------------------


def guarded_weights(weights: np.ndarray) -> tuple[torch.Tensor, Any]:
    """``weights`` copied to a CPU tensor that ends where an unreadable page starts:
    a load of any word past its end faults. Returns the tensor and the mapping (keep it
    alive while the tensor is used)."""
    page = mmap.PAGESIZE
    size = -(-weights.nbytes // page) * page
    region = mmap.mmap(-1, size + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    words = np.frombuffer(region, dtype=np.int64, count=(size + page) // 8)
    table = words[size // 8 - weights.size : size // 8]
    table[:] = weights
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(address + size, page, 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect")
    return torch.from_numpy(table), region


# (pool_shift, row_gap, tile_bytes): the payload's last item on the 4-byte path (rows at
# 0 mod 16), on the 16-byte path (4 mod 16), on the byte path (odd rows); whole pages in
# one tile, so a masked lane reaches up to a tile past the payload's end.
GUARDED_CONFIGS = [(0, 0, TILE_BYTES), (4, 0, TILE_BYTES), (1, 3, 256)]


def guarded_run() -> dict[str, object]:
    """Keyed stores and loads, copying and read-only, with the table's end against an
    unreadable page; the sums against the judge. Run in a subprocess (a fault kills it)."""
    last_item_paths = []
    checked = 0
    regions = []  # mapped until the process ends (the tensors export their buffers)
    for pool_shift, row_gap, tile_bytes in GUARDED_CONFIGS:
        case = Case(
            torch.device("cpu"), pool_shift, row_gap, tile_bytes, planes=TAIL_PLANES, num_groups=1
        )
        weights = random_weights(table_words(case), pool_shift + row_gap)
        table, region = guarded_weights(weights)
        regions.append(region)
        for direction in DIRECTIONS:
            for write in (True, False):
                pairs, offsets = job(7, counts=(5,))
                last = pairs[pairs[:, 2] == 2]  # the payload's last slot: the 270-byte page's
                last_paths = item_paths(
                    case, last, torch.tensor([0, 2]), TAIL_PLANES[1].pool_offset
                )
                last_item_paths.append(sorted(last_paths))
                case.fill(7)
                masks = case.masks(pairs, offsets)
                # The pool a copy leaves: a store's (or its read-only pass's) sums are of
                # the cache bytes, a load's of the pool's.
                pool = case.expected_copy(pairs, offsets, direction)[-1]
                sums = launch(
                    case,
                    pairs,
                    offsets,
                    direction,
                    pages=page_of_row(7),
                    write=write,
                    num_programs=2,
                    page_weights=table,
                )
                want = keyed_row_sums(case, pool, masks[-1], weights)
                if sums != want:
                    return {"ok": False, "case": [pool_shift, row_gap, tile_bytes]}
                checked += 1
    return {"ok": True, "checked": checked, "last_item_paths": last_item_paths[::4]}


def test_no_weight_is_read_past_the_table() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, __file__, "guarded"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"exit {result.returncode} (-11: a load past the weights table faulted)\n"
        + result.stderr[-4000:]
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["checked"] == 4 * len(GUARDED_CONFIGS), report
    # The payload's last item (the 270-byte page's slot 2, with its 2-byte tail), in the
    # two rows that hold it: 4-byte words, 16-byte words, bytes only.
    assert report["last_item_paths"] == [[1, 4], [1, 16], [1]]


if __name__ == "__main__":
    if sys.argv[1:] == ["guarded"]:
        print(json.dumps(guarded_run()))
