"""The copy kernel (run under TRITON_INTERPRET=1 on CPU tensors) against the torch reference.

Every case checks three things byte-exactly: the source is unchanged, the addressed
destination bytes equal the reference, and destination bytes no pair addresses still
hold the poison written before the launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_offload.kernels.copy_blocks import (
    TILE_BYTES,
    default_num_programs,
    grid_size,
    launch_copy,
)

from triton_offload.transfer import layout as layout_module
from triton_offload.transfer.copiers import copy_blocks, kernel_tables
from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import CacheLayout
from triton_offload.transfer.reference import byte_plane, reference_copy

DIRECTIONS = [Direction.TO_POOL, Direction.FROM_POOL]


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor's memory."""
    assert tensor.is_contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def random_bytes(tensor: torch.Tensor, generator: torch.Generator) -> None:
    data = raw_bytes(tensor)
    data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator))


@dataclass
class Plane:
    """A plane inside a backing tensor; all sizes in bytes."""

    backing: int
    group: int
    offset: int
    stride: int
    page: int
    num_blocks: int


@dataclass
class Case:
    backings: list[torch.Tensor]
    planes: list[Plane]
    pool_offsets: list[int]
    num_groups: int
    blocks_per_chunk: int
    pool_rows: int
    pool_row_bytes: int
    pool_shift: int = 0
    #: bytes between pool rows; more than pool_row_bytes leaves gaps no copy may touch
    pool_row_stride: int = 0
    pool_buffer: torch.Tensor = field(init=False)
    pool: torch.Tensor = field(init=False)
    layout: CacheLayout = field(init=False)

    def __post_init__(self) -> None:
        stride = self.pool_row_stride = max(self.pool_row_stride, self.pool_row_bytes)
        # The pool is a (row-strided) view into a larger buffer, so its address can be
        # made odd and its rows spaced wider than they hold.
        self.pool_buffer = torch.empty(
            self.pool_shift + self.pool_rows * stride + 64, dtype=torch.uint8
        )
        self.pool = self.pool_buffer.as_strided(
            (self.pool_rows, self.pool_row_bytes), (stride, 1), self.pool_shift
        )
        geometries = [
            layout_module.Plane.of_view(view, group=plane.group, pool_offset=offset)
            for view, plane, offset in zip(
                self.views(self.backings), self.planes, self.pool_offsets, strict=True
            )
        ]
        self.layout = CacheLayout.from_planes(
            geometries,
            num_groups=self.num_groups,
            blocks_per_chunk=self.blocks_per_chunk,
            row_bytes=self.pool_row_bytes,
            device="cpu",
        )

    def outside_pool(self) -> torch.Tensor:
        """Bool mask of the pool buffer's bytes that no pool row holds (gaps, margins)."""
        outside = torch.ones(self.pool_buffer.numel(), dtype=torch.bool)
        for row in range(self.pool_rows):
            start = self.pool_shift + row * self.pool_row_stride
            outside[start : start + self.pool_row_bytes] = False
        return outside

    def views(self, backings: list[torch.Tensor]) -> list[torch.Tensor]:
        return [
            raw_bytes(backings[p.backing]).as_strided(
                (p.num_blocks, p.page), (p.stride, 1), p.offset
            )
            for p in self.planes
        ]

    def addressed(
        self, pairs: torch.Tensor, group_offsets: torch.Tensor, direction: Direction
    ) -> list[torch.Tensor]:
        """Bool masks of the destination bytes the job writes, computed independently."""
        if direction == Direction.TO_POOL:
            mask = torch.zeros(self.pool.shape, dtype=torch.bool).reshape(-1)
            for group in range(self.num_groups):
                lo, hi = int(group_offsets[group]), int(group_offsets[group + 1])
                for _, row, slot in pairs[lo:hi].tolist():
                    for plane, offset in zip(self.planes, self.pool_offsets, strict=True):
                        if plane.group == group:
                            start = row * self.pool_row_bytes + offset + slot * plane.page
                            mask[start : start + plane.page] = True
            return [mask.view(self.pool.shape)]
        masks = [torch.zeros(raw_bytes(b).shape, dtype=torch.bool) for b in self.backings]
        for group in range(self.num_groups):
            lo, hi = int(group_offsets[group]), int(group_offsets[group + 1])
            for block, _, _ in pairs[lo:hi].tolist():
                for plane in self.planes:
                    if plane.group == group:
                        start = plane.offset + block * plane.stride
                        masks[plane.backing][start : start + plane.page] = True
        return masks


def simple_case(
    pages: list[tuple[int, int]],
    *,
    num_groups: int,
    blocks_per_chunk: int = 2,
    pool_rows: int = 12,
    num_blocks: int = 8,
    pad: int = 0,
    pool_gap: int = 0,
    pool_shift: int = 0,
    row_gap: int = 0,
    dtype: torch.dtype = torch.uint8,
) -> Case:
    """One backing tensor per plane; ``pages`` = [(group, page_bytes)] ordered by group.

    Rows are plane-major per group: a group's planes follow each other in the row, with
    ``pool_gap`` spare bytes after each (odd gaps give odd pool offsets). ``row_gap``
    spaces the pool rows that many bytes wider than they hold (a row-strided pool).
    """
    element = torch.empty((), dtype=dtype).element_size()
    backings, planes, offsets = [], [], []
    used = [0] * num_groups
    for group, page in pages:
        stride = page + pad
        assert stride % element == 0
        backings.append(torch.empty(num_blocks, stride // element, dtype=dtype))
        planes.append(Plane(len(backings) - 1, group, 0, stride, page, num_blocks))
        offsets.append(used[group])
        used[group] += blocks_per_chunk * page + pool_gap
    row_bytes = max(max(used), 1) + 5
    return Case(
        backings,
        planes,
        offsets,
        num_groups,
        blocks_per_chunk,
        pool_rows,
        row_bytes,
        pool_shift,
        row_bytes + row_gap,
    )


def run_and_check(
    case: Case,
    pairs: torch.Tensor,
    group_offsets: torch.Tensor,
    direction: Direction,
    *,
    num_programs: int | None = None,
    seed: int = 0,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    for backing in case.backings:
        random_bytes(backing, generator)
    random_bytes(case.pool_buffer, generator)  # the pool's poison (or source) bytes
    if direction == Direction.TO_POOL:
        sources = [raw_bytes(b) for b in case.backings]
        destinations = [case.pool]
    else:
        sources = [case.pool]
        destinations = [raw_bytes(b) for b in case.backings]
    source_before = [s.clone() for s in sources]
    poison = [d.clone() for d in destinations]
    buffer_before = case.pool_buffer.clone()

    # Expected result: the reference on copies of the destination.
    if direction == Direction.TO_POOL:
        expected = [case.pool.clone()]
        reference_copy(
            case.views(case.backings), case.layout, pairs, group_offsets, expected[0], direction
        )
    else:
        copies = [b.clone() for b in case.backings]
        reference_copy(case.views(copies), case.layout, pairs, group_offsets, case.pool, direction)
        expected = [raw_bytes(c) for c in copies]

    copy_blocks(case.layout, pairs, group_offsets, case.pool, direction, num_programs=num_programs)

    for before, now in zip(source_before, sources, strict=True):
        assert torch.equal(before, now), "source changed"
    masks = case.addressed(pairs, group_offsets, direction)
    for mask, want, got, old in zip(masks, expected, destinations, poison, strict=True):
        assert torch.equal(got[mask], want[mask]), "addressed destination bytes differ"
        assert torch.equal(got[~mask], old[~mask]), "unaddressed destination bytes changed"
        assert torch.equal(got, want)
    # Bytes of the pool's backing buffer outside the pool rows (margins, and the gaps
    # between rows of a row-strided pool) are never touched.
    outside = case.outside_pool()
    assert torch.equal(case.pool_buffer[outside], buffer_before[outside])


def random_pairs(
    case: Case, counts: list[int], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random permutations: distinct GPU blocks and (row, slot) pages per group.

    Each group gets its own pool rows (one chunk of one group per row, as the engine
    allocates them), drawn at random, and random slots inside them.
    """
    bpc = case.blocks_per_chunk
    free_rows = torch.randperm(case.pool_rows, generator=generator).tolist()
    rows = []
    for group, count in enumerate(counts):
        # A group without planes has no block limit; any ids will do.
        num_blocks = min(int(case.layout.group_num_blocks[group]), 64)
        blocks = torch.randperm(num_blocks, generator=generator)
        own_rows = [free_rows.pop() for _ in range(-(-count // bpc))]
        pages = torch.randperm(len(own_rows) * bpc, generator=generator)
        for k in range(count):
            page = int(pages[k])
            rows.append((int(blocks[k]), own_rows[page // bpc], page % bpc))
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    pairs = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    return pairs, torch.tensor(offsets, dtype=torch.int64)


def job_pairs(
    gpu_blocks: list[list[int]],
    host_chunks: list[list[int]],
    first_block_index: list[int],
    blocks_per_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's mapping: k-th block of group g -> chunk H[p // bpc], slot p % bpc."""
    rows, offsets = [], [0]
    for blocks, chunks, first in zip(gpu_blocks, host_chunks, first_block_index, strict=True):
        for k, block in enumerate(blocks):
            position = first % blocks_per_chunk + k
            rows.append((block, chunks[position // blocks_per_chunk], position % blocks_per_chunk))
        offsets.append(len(rows))
    return (
        torch.tensor(rows, dtype=torch.int64).reshape(-1, 3),
        torch.tensor(offsets, dtype=torch.int64),
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_random_permutation_of_blocks(dtype: torch.dtype, direction: Direction) -> None:
    element = torch.empty((), dtype=dtype).element_size()
    case = simple_case(
        [(0, 96 * element), (0, 96 * element), (1, 40 * element)],
        num_groups=2,
        blocks_per_chunk=2,
        num_blocks=12,
        pad=8 * element,
        dtype=dtype,
    )
    pairs, offsets = random_pairs(case, [7, 5], torch.Generator().manual_seed(1))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_odd_page_sizes_odd_strides_and_odd_pool_offsets(direction: Direction) -> None:
    # 37 and 203 are not multiples of 4; 1001 is odd; TILE_BYTES + 13 spans two tiles.
    case = simple_case(
        [(0, 37), (0, 203), (1, 1001), (1, TILE_BYTES + 13)],
        num_groups=2,
        blocks_per_chunk=3,
        num_blocks=5,
        pad=3,
        pool_gap=5,
    )
    pairs, offsets = random_pairs(case, [5, 3], torch.Generator().manual_seed(2))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_partially_skipped_first_chunk_with_three_blocks_per_chunk(direction: Direction) -> None:
    case = simple_case([(0, 64), (0, 48), (1, 80)], num_groups=2, blocks_per_chunk=3)
    # Group 0 starts at logical block 4: positions 1..5 -> chunk 2 slots 1, 2; chunk 5 slots
    # 0, 1, 2. Group 1 starts at block 2: position 2 -> chunk 0 slot 2.
    pairs, offsets = job_pairs([[6, 0, 3, 7, 2], [5]], [[2, 5], [0]], [4, 2], 3)
    assert pairs[:2, 1:].tolist() == [[2, 1], [2, 2]]
    run_and_check(case, pairs, offsets, direction)
    if direction == Direction.TO_POOL:
        # Slot 0 of the first chunk was skipped: still poison, checked via the mask above;
        # spelled out here because it is the bug a partial chunk invites.
        mask = case.addressed(pairs, offsets, direction)[0]
        assert not mask[2, : 3 * 64].reshape(3, 64)[0].any()


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("counts", [[0, 3, 2], [3, 0, 2], [3, 2, 0], [0, 0, 1]])
def test_empty_groups(counts: list[int], direction: Direction) -> None:
    case = simple_case([(0, 48), (1, 100), (2, 32)], num_groups=3)
    pairs, offsets = random_pairs(case, counts, torch.Generator().manual_seed(3))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_single_block(direction: Direction) -> None:
    case = simple_case([(0, 256)], num_groups=1, num_blocks=1, pool_rows=1, blocks_per_chunk=1)
    pairs = torch.tensor([[0, 0, 0]])
    run_and_check(case, pairs, torch.tensor([0, 1]), direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_three_groups_of_different_page_sizes_in_one_launch(direction: Direction) -> None:
    # Attention group (2 x 4 KiB bf16 planes), Mamba group (1,536-byte conv plane and a
    # 64 KiB fp32 SSM plane), and a third group of 520-byte pages.
    case = simple_case(
        [(0, 4096), (0, 4096), (1, 1536), (1, 65536), (2, 520)],
        num_groups=3,
        blocks_per_chunk=2,
        num_blocks=4,
        pool_rows=5,
    )
    pairs, offsets = random_pairs(case, [3, 2, 3], torch.Generator().manual_seed(4))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("pool_shift", [1, 3, 4, 8, 12])
def test_pool_at_an_arbitrary_address(pool_shift: int, direction: Direction) -> None:
    # Odd shifts force the byte path; 4 and 12 the 4-byte path; 8 the 8-byte path.
    case = simple_case(
        [(0, 256), (0, 1000), (1, 96)], num_groups=2, num_blocks=6, pool_shift=pool_shift
    )
    pairs, offsets = random_pairs(case, [4, 3], torch.Generator().manual_seed(5))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("row_gap", [16, 37])
def test_row_strided_pool_leaves_the_gaps_alone(row_gap: int, direction: Direction) -> None:
    # A worker's view into a shared region: its rows sit row_bytes + row_gap apart and the
    # bytes between them belong to other workers (poisoned here, checked unchanged).
    case = simple_case(
        [(0, 64), (0, 200), (1, 48)], num_groups=2, blocks_per_chunk=2, row_gap=row_gap
    )
    assert case.pool.stride(0) == case.pool_row_bytes + row_gap
    pairs, offsets = random_pairs(case, [5, 3], torch.Generator().manual_seed(12))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("pool_shift", [1, 4, 8])
def test_full_tiles_on_the_narrow_paths(pool_shift: int, direction: Direction) -> None:
    # A full tile is 1,024 words on the 8-byte path, 2,048 on the 4-byte path and 8,192
    # bytes on the byte path: several steps of each path's loop. TILE_BYTES + 13 adds a
    # short second tile and a tail.
    case = simple_case(
        [(0, TILE_BYTES), (1, TILE_BYTES + 13)],
        num_groups=2,
        num_blocks=4,
        pool_rows=4,
        pool_shift=pool_shift,
    )
    pairs, offsets = random_pairs(case, [3, 2], torch.Generator().manual_seed(9))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("num_programs", [1, 2, 5, 64])
def test_any_grid_size_covers_every_item(num_programs: int) -> None:
    case = simple_case([(0, 64), (0, TILE_BYTES + 32), (1, 16)], num_groups=2, num_blocks=6)
    pairs, offsets = random_pairs(case, [5, 4], torch.Generator().manual_seed(6))
    run_and_check(case, pairs, offsets, Direction.TO_POOL, num_programs=num_programs)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_kv_planes_of_one_tensor(direction: Direction) -> None:
    # FlashAttention (2, num_blocks, ...) K/V planes and a (num_blocks, 2, ...) layout whose
    # K and V pages interleave: both views come from byte_plane on real tensors.
    flash = torch.empty(2, 6, 8, 4, dtype=torch.bfloat16)
    interleaved = torch.empty(6, 2, 8, 4, dtype=torch.bfloat16)
    page = 8 * 4 * 2
    planes = [
        Plane(0, 0, 0, page, page, 6),
        Plane(0, 0, 6 * page, page, page, 6),
        Plane(1, 1, 0, 2 * page, page, 6),
        Plane(1, 1, page, 2 * page, page, 6),
    ]
    case = Case([flash, interleaved], planes, [0, 2 * page, 0, 2 * page], 2, 2, 4, 4 * page)
    views = case.views(case.backings)
    expected_views = [
        byte_plane(flash[0]),
        byte_plane(flash[1]),
        byte_plane(interleaved[:, 0]),
        byte_plane(interleaved[:, 1]),
    ]
    for view, expected in zip(views, expected_views, strict=True):
        assert view.data_ptr() == expected.data_ptr()
        assert view.shape == expected.shape and view.stride() == expected.stride()
    pairs, offsets = random_pairs(case, [4, 3], torch.Generator().manual_seed(7))
    run_and_check(case, pairs, offsets, direction)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_groups_aliasing_the_same_cache_memory(direction: Direction) -> None:
    # Hybrid allocators let layers of different groups share one tensor; block ids keep
    # them apart. Group 0 uses blocks 0-3 of it, group 1 blocks 4-7.
    shared = torch.empty(8, 128, dtype=torch.uint8)
    planes = [Plane(0, 0, 0, 128, 128, 8), Plane(0, 1, 0, 128, 96, 8)]
    case = Case([shared], planes, [0, 0], 2, 2, 4, 256)
    assert case.layout.cache_alias_groups == ((0, 1),)
    pairs = torch.tensor([[2, 0, 0], [0, 1, 1], [5, 2, 0], [7, 3, 1]])
    run_and_check(case, pairs, torch.tensor([0, 2, 4]), direction)


def test_store_then_load_round_trips() -> None:
    case = simple_case([(0, 160), (1, 77)], num_groups=2, num_blocks=6)
    pairs, offsets = random_pairs(case, [4, 3], torch.Generator().manual_seed(8))
    generator = torch.Generator().manual_seed(9)
    for backing in case.backings:
        random_bytes(backing, generator)
    original = [b.clone() for b in case.backings]
    copy_blocks(case.layout, pairs, offsets, case.pool, Direction.TO_POOL)
    for backing in case.backings:
        backing.fill_(0)
    copy_blocks(case.layout, pairs, offsets, case.pool, 1)  # a plain int direction works too
    for before, after, plane in zip(original, case.backings, case.planes, strict=True):
        group = plane.group
        blocks = pairs[int(offsets[group]) : int(offsets[group + 1]), 0]
        assert torch.equal(after[blocks], before[blocks])


def test_empty_job_launches_nothing() -> None:
    case = simple_case([(0, 32)], num_groups=1)
    case.pool.fill_(7)
    empty = torch.zeros(0, 3, dtype=torch.int64)
    tables = kernel_tables(case.layout, case.pool_row_stride, TILE_BYTES, torch.device("cpu"))
    launch_copy(tables, empty, torch.tensor([0, 0]), case.pool.data_ptr(), 0)
    copy_blocks(case.layout, empty, torch.tensor([0, 0]), case.pool, Direction.TO_POOL)
    assert bool((case.pool == 7).all())


def test_default_grid_on_cpu_is_small() -> None:
    assert default_num_programs("cpu") == 4
    assert default_num_programs("cpu", 100) == 4


def test_grid_keeps_enough_bytes_in_flight() -> None:
    # 256 KiB in flight: 32 programs of full 8 KiB tiles, 128 of 2 KiB, 256 of 1 KiB;
    # at most two programs per SM.
    assert grid_size(132, TILE_BYTES) == 32
    assert grid_size(132, 2048) == 128
    assert grid_size(132, 1024) == 256
    assert grid_size(132, 1000) == 263  # ceil(262144 / 1000)
    assert grid_size(132, 512) == 264  # 2 x 132 SMs
    assert grid_size(132, 1) == 264
    assert grid_size(16, TILE_BYTES) == 32
    assert grid_size(8, TILE_BYTES) == 16
    assert grid_size(132, 10 * TILE_BYTES) == 32  # an item is never more than one tile


def test_layout_tiles_and_mean_item_size() -> None:
    case = simple_case(
        [(0, 4096), (0, 4096), (1, 1536), (1, 65536), (2, 520)], num_groups=3, num_blocks=2
    )
    layout = kernel_tables(case.layout, case.pool_row_stride, TILE_BYTES, torch.device("cpu"))
    # Tiles: 1 + 1 for group 0, 1 + 8 for group 1, 1 for group 2.
    assert layout.group_table.tolist() == [[2, 0], [9, 2], [1, 11]]
    assert layout.tile_table.shape == (12, 5)
    assert layout.mean_tile_bytes == (2 * 4096 + 1536 + 65536 + 520) // 12
    # Tile rows of the SSM plane: offsets 0, 8 KiB, ... inside the page and the pool slot.
    ssm = layout.tile_table[3:11]
    assert (ssm[:, 0] - ssm[0, 0]).tolist() == [k * TILE_BYTES for k in range(8)]
    assert (ssm[:, 2] - ssm[0, 2]).tolist() == [k * TILE_BYTES for k in range(8)]
    assert set(ssm[:, 4].tolist()) == {TILE_BYTES}


def test_byte_plane_of_a_strided_tensor() -> None:
    base = torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12)
    view = byte_plane(base[:, :8])  # each block's first 8 floats; stride 12 floats
    assert view.shape == (5, 32) and view.stride() == (48, 1)
    assert torch.equal(view[3], base[3, :8].contiguous().view(torch.uint8))
    assert byte_plane(base, page_bytes=20).shape == (5, 20)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pages=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 300)), min_size=1, max_size=4).map(
        sorted
    ),
    counts=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    blocks_per_chunk=st.integers(1, 3),
    pool_shift=st.integers(0, 17),
    direction=st.sampled_from(DIRECTIONS),
    num_programs=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_random_jobs_match_the_reference(
    pages: list[tuple[int, int]],
    counts: list[int],
    blocks_per_chunk: int,
    pool_shift: int,
    direction: Direction,
    num_programs: int,
    seed: int,
) -> None:
    case = simple_case(
        pages,
        num_groups=3,
        blocks_per_chunk=blocks_per_chunk,
        num_blocks=5,
        pool_rows=12,
        pad=seed % 5,
        pool_gap=seed % 3,
        pool_shift=pool_shift,
        row_gap=(seed // 7) % 3 * 11,
    )
    counts = [min(c, 5) for c in counts]
    pairs, offsets = random_pairs(case, counts, torch.Generator().manual_seed(seed))
    run_and_check(case, pairs, offsets, direction, num_programs=num_programs, seed=seed)
