"""Bad geometry and bad pair tables are rejected with an error naming the value, before launch."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload.transfer import jobs
from triton_offload.transfer.copiers import copy_blocks
from triton_offload.transfer.jobs import Direction, JobSpec
from triton_offload.transfer.layout import CacheLayout, Plane
from triton_offload.transfer.reference import byte_plane

BPC = 2
ROWS = 6


def plane(**overrides: int) -> Plane:
    fields = dict(
        group=0, base_address=1 << 20, block_stride=256, page_bytes=256, num_blocks=8, pool_offset=0
    )
    fields.update(overrides)
    return Plane(**fields)  # type: ignore[arg-type]


def build(planes: list[Plane], **overrides: object) -> CacheLayout:
    kwargs: dict[str, object] = dict(
        num_groups=2, blocks_per_chunk=BPC, row_bytes=1024, device="cpu"
    )
    kwargs.update(overrides)
    return CacheLayout.from_planes(planes, **kwargs)  # type: ignore[arg-type]


def validate_pairs(layout: CacheLayout, pairs: object, offsets: object, direction: object) -> None:
    """The library's check of a pair table against a pool of ROWS rows."""
    jobs.validate_pairs(layout, ROWS, pairs, offsets, direction)  # type: ignore[arg-type]


@pytest.fixture
def layout() -> CacheLayout:
    # Group 0: two planes (8 blocks), group 1: one plane of 5 blocks in separate memory.
    return build(
        [
            plane(),
            plane(base_address=1 << 21, pool_offset=BPC * 256),
            plane(group=1, base_address=1 << 22, page_bytes=100, num_blocks=5),
        ]
    )


GOOD_PAIRS = [[1, 0, 0], [3, 0, 1], [2, 4, 1]]
GOOD_OFFSETS = [0, 2, 3]


def check(layout: CacheLayout, pairs: list[list[int]], offsets: list[int], direction: int) -> None:
    validate_pairs(layout, torch.tensor(pairs).reshape(-1, 3), torch.tensor(offsets), direction)


def test_good_tables_pass(layout: CacheLayout) -> None:
    for direction in Direction:
        check(layout, GOOD_PAIRS, GOOD_OFFSETS, direction)
        validate_pairs(layout, np.array(GOOD_PAIRS), np.array(GOOD_OFFSETS), direction)


# ---- ids, rows and slots out of range -------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "group", "message"),
    [
        ([-1, 0, 0], 0, r"GPU block id -1 at pair 0 \(group 0\) out of range \[0, 8\)"),
        ([8, 0, 0], 0, r"GPU block id 8 at pair 0 \(group 0\) out of range \[0, 8\)"),
        # Group 1's plane has 5 blocks: id 5 is fine for group 0 but not for group 1.
        ([5, 0, 0], 1, r"GPU block id 5 at pair 0 \(group 1\) out of range \[0, 5\)"),
        ([0, -2, 0], 0, r"pool row -2 at pair 0 \(group 0\) out of range \[0, 6\)"),
        ([0, 6, 0], 0, r"pool row 6 at pair 0 \(group 0\) out of range \[0, 6\)"),
        ([0, 0, -1], 1, r"slot -1 at pair 0 \(group 1\) out of range \[0, 2\)"),
        ([0, 0, 2], 0, r"slot 2 at pair 0 \(group 0\) out of range \[0, 2\)"),
    ],
)
def test_ids_out_of_range(layout: CacheLayout, pair: list[int], group: int, message: str) -> None:
    offsets = [0, 1, 1] if group == 0 else [0, 0, 1]
    for direction in Direction:
        with pytest.raises(ValueError, match=message):
            check(layout, [pair], offsets, direction)


def test_error_names_the_first_bad_pair(layout: CacheLayout) -> None:
    with pytest.raises(ValueError, match=r"GPU block id 99 at pair 2 \(group 1\)"):
        check(layout, [[0, 0, 0], [1, 1, 0], [99, 2, 0]], [0, 2, 3], Direction.TO_POOL)


# ---- table shapes and group offsets --------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, 2], r"group_offsets must have shape \[3\]"),
        ([0, 1, 2, 3], r"group_offsets must have shape \[3\]"),
        ([1, 2, 3], r"group_offsets\[0\] is 1"),
        ([0, 3, 2], r"group_offsets decrease at group 1: 3 then 2"),
        ([0, 2, 4], r"group_offsets\[-1\] is 4 but pairs has 3 rows"),
        ([0, 1, 2], r"group_offsets\[-1\] is 2 but pairs has 3 rows"),
    ],
)
def test_mismatched_table_lengths(layout: CacheLayout, offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check(layout, GOOD_PAIRS, offsets, Direction.TO_POOL)


def test_pairs_shape_and_dtype(layout: CacheLayout) -> None:
    with pytest.raises(ValueError, match=r"pairs must have shape \[n, 3\], got \(3, 2\)"):
        validate_pairs(layout, torch.zeros(3, 2, dtype=torch.int64), torch.tensor([0, 3, 3]), 0)
    with pytest.raises(TypeError, match=r"pairs must hold integers, got torch\.float32"):
        validate_pairs(layout, torch.zeros(3, 3), torch.tensor([0, 3, 3]), 0)
    with pytest.raises(TypeError, match="group_offsets must hold integers, got float64"):
        validate_pairs(layout, np.zeros((3, 3), dtype=np.int64), np.array([0.0, 3.0, 3.0]), 0)


def test_bad_direction(layout: CacheLayout) -> None:
    with pytest.raises(ValueError, match="direction 2 is not a Direction"):
        check(layout, GOOD_PAIRS, GOOD_OFFSETS, 2)


# ---- two pairs writing the same destination page -------------------------------------


def test_store_to_the_same_pool_page_twice(layout: CacheLayout) -> None:
    pairs = [[1, 0, 0], [3, 4, 1], [5, 4, 1], [2, 3, 1]]
    with pytest.raises(ValueError, match=r"pairs 1 and 2 both write pool row 4 slot 1 \(group 0\)"):
        check(layout, pairs, [0, 3, 4], Direction.TO_POOL)
    # Loading one pool page into two GPU blocks is fine.
    check(layout, pairs, [0, 3, 4], Direction.FROM_POOL)


def test_load_into_the_same_gpu_block_twice(layout: CacheLayout) -> None:
    pairs = [[1, 0, 0], [3, 1, 0], [1, 2, 0], [1, 3, 1]]
    with pytest.raises(ValueError, match=r"pairs 0 and 2 both write GPU block id 1 \(group 0\)"):
        check(layout, pairs, [0, 3, 4], Direction.FROM_POOL)
    # Storing one GPU block into two pool pages is fine; block 1 of group 1 is other memory.
    check(layout, pairs, [0, 3, 4], Direction.TO_POOL)


def test_load_into_the_same_block_of_two_aliasing_groups() -> None:
    # Groups 0 and 1 share one cache tensor: block 3 of both is the same memory.
    aliasing = build([plane(), plane(group=1, page_bytes=128)])
    assert aliasing.cache_alias_groups == ((0, 1),)
    pairs = [[3, 0, 0], [3, 1, 0]]
    with pytest.raises(ValueError, match="GPU block id 3 is written by groups 0 and 1"):
        check(aliasing, pairs, [0, 1, 2], Direction.FROM_POOL)
    check(aliasing, [[3, 0, 0], [4, 1, 0]], [0, 1, 2], Direction.FROM_POOL)


def test_interleaved_planes_of_two_groups_do_not_alias() -> None:
    # K pages at even 256-byte slots, V pages at odd ones: same range, no shared byte.
    interleaved = build(
        [plane(block_stride=512), plane(group=1, base_address=(1 << 20) + 256, block_stride=512)]
    )
    assert interleaved.cache_alias_groups == ()
    check(interleaved, [[3, 0, 0], [3, 1, 0]], [0, 1, 2], Direction.FROM_POOL)


def test_store_into_one_row_from_two_groups_sharing_row_bytes(layout: CacheLayout) -> None:
    # Both groups' planes start at byte 0 of a row: one row cannot hold chunks of both.
    assert layout.pool_shared_groups == ((0, 1),)
    with pytest.raises(ValueError, match="pool row 4 is written by groups 0 and 1"):
        check(layout, [[1, 4, 0], [2, 4, 1]], [0, 1, 2], Direction.TO_POOL)
    disjoint = build([plane(), plane(group=1, base_address=1 << 22, pool_offset=BPC * 256)])
    assert disjoint.pool_shared_groups == ()
    check(disjoint, [[1, 4, 0], [2, 4, 1]], [0, 1, 2], Direction.TO_POOL)


# ---- geometry that does not fit ------------------------------------------------------


@pytest.mark.parametrize(
    ("planes", "message"),
    [
        ([plane(group=2)], r"plane 0 group 2 out of range \[0, 2\)"),
        ([plane(group=-1)], "plane 0 group -1 must be >= 0"),
        ([plane(group=1), plane(base_address=1 << 22)], "plane 1 group 0 follows group 1"),
        ([plane(page_bytes=0)], "plane 0 page_bytes 0 must be >= 1"),
        ([plane(num_blocks=0)], "plane 0 num_blocks 0 must be >= 1"),
        ([plane(block_stride=0)], "plane 0 block_stride 0 must be >= 1"),
        ([plane(block_stride=200)], "plane 0 block_stride 200 is smaller than page_bytes 256"),
        ([plane(base_address=0)], "plane 0 base_address 0 must be >= 1"),
        ([plane(pool_offset=-4)], "plane 0 pool_offset -4 must be >= 0"),
        (
            [plane(pool_offset=600)],
            r"plane 0 pool_offset 600 \+ 2 slots x 256 bytes exceeds row_bytes 1024",
        ),
        (
            [plane(), plane(base_address=1 << 22, pool_offset=300)],
            r"plane 1 pool_offset 300 overlaps plane 0's slots \(ending at byte 512\)",
        ),
        ([plane(base_address=(1 << 63) - 100)], "plane 0 address range overflows int64"),
    ],
)
def test_bad_plane_geometry(planes: list[Plane], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(planes)


def test_bad_layout_sizes() -> None:
    with pytest.raises(ValueError, match="blocks_per_chunk 0 must be >= 1"):
        build([plane()], blocks_per_chunk=0)
    with pytest.raises(ValueError, match="num_groups 0 must be >= 1"):
        build([plane()], num_groups=0)
    with pytest.raises(ValueError, match="row_bytes 0 must be >= 1"):
        build([plane()], row_bytes=0)
    with pytest.raises(TypeError, match=r"plane 0 page_bytes must be an int, got 256\.0"):
        build([dataclasses.replace(plane(), page_bytes=256.0)])
    with pytest.raises(TypeError, match="plane 0 must be a Plane"):
        build([(0, 1, 2, 3, 4, 5)])  # type: ignore[list-item]


def test_views_whose_pages_do_not_fit_their_tensors() -> None:
    cache = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block stride 16 bytes is smaller than the 64 bytes"):
        Plane.of_view(cache.as_strided((4, 64), (16, 1)), group=0, pool_offset=0)
    with pytest.raises(ValueError, match=r"block are not contiguous .*strides \(1, 4\)"):
        Plane.of_view(cache.as_strided((4, 16), (1, 4)), group=0, pool_offset=0)
    with pytest.raises(ValueError, match=r"must be uint8 \[num_blocks, page_bytes\], got torch.f"):
        Plane.of_view(torch.zeros(4, 4), group=0, pool_offset=0)
    with pytest.raises(ValueError, match="page_bytes 65 does not fit a block region of 64 bytes"):
        byte_plane(cache, page_bytes=65)
    with pytest.raises(ValueError, match="page_bytes 0 does not fit"):
        byte_plane(cache, page_bytes=0)
    with pytest.raises(ValueError, match=r"per-block region of shape .* is not contiguous"):
        byte_plane(torch.zeros(4, 8, 8).transpose(1, 2))


# ---- copy_blocks: the pool tensor, and nothing moves on error --------------------------


def real_layout(cache: torch.Tensor) -> CacheLayout:
    return CacheLayout.from_planes(
        [Plane.of_view(byte_plane(cache), group=0, pool_offset=0)],
        num_groups=1,
        blocks_per_chunk=BPC,
        row_bytes=BPC * 32,
        device="cpu",
    )


def test_pool_that_does_not_fit() -> None:
    cache = torch.arange(8 * 32, dtype=torch.int32).to(torch.uint8).reshape(8, 32)
    layout = real_layout(cache)
    pairs, offsets = torch.tensor([[0, 0, 0]]), torch.tensor([0, 1])
    narrow = torch.zeros(ROWS, BPC * 32 - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pool must be a uint8 \[rows, >= 64\] tensor, got"):
        copy_blocks(layout, pairs, offsets, narrow, Direction.TO_POOL)
    strided = torch.zeros(ROWS, 2 * BPC * 32, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"pool rows must be contiguous, got strides \(128, 2\)"):
        copy_blocks(layout, pairs, offsets, strided, Direction.TO_POOL)
    few_rows = torch.zeros(2, BPC * 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pool row 2 at pair 0 \(group 0\) out of range \[0, 2\)"):
        copy_blocks(layout, torch.tensor([[0, 2, 0]]), offsets, few_rows, Direction.TO_POOL)
    with pytest.raises(TypeError, match=r"pool must be a torch\.Tensor, got ndarray"):
        copy_blocks(layout, pairs, offsets, np.zeros(1024, np.uint8), 0)  # type: ignore[arg-type]
    pool = torch.zeros(ROWS, BPC * 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="num_programs 0 must be >= 1"):
        copy_blocks(layout, pairs, offsets, pool, Direction.TO_POOL, num_programs=0)
    with pytest.raises(ValueError, match="num_programs 65537 must be at most 65536"):
        copy_blocks(layout, pairs, offsets, pool, Direction.TO_POOL, num_programs=65537)


@pytest.mark.parametrize("direction", list(Direction))
def test_nothing_moves_when_the_last_pair_is_bad(direction: Direction) -> None:
    cache = torch.arange(8 * 32, dtype=torch.int32).to(torch.uint8).reshape(8, 32)
    layout = real_layout(cache)
    pool = torch.full((ROWS, BPC * 32), 0xEE, dtype=torch.uint8)
    cache_before, pool_before = cache.clone(), pool.clone()
    pairs = torch.tensor([[0, 0, 0], [1, 0, 1], [2, 1, 0], [3, ROWS, 0]])
    with pytest.raises(ValueError, match="pool row 6 at pair 3"):
        copy_blocks(layout, pairs, torch.tensor([0, 4]), pool, direction)
    assert torch.equal(cache, cache_before)
    assert torch.equal(pool, pool_before)


def test_clash_between_groups_that_are_not_neighbours_in_a_row() -> None:
    # Groups 0 and 2 share row bytes [0, 512); group 1 sits in [512, 1024) apart from both.
    layout = build(
        [
            plane(),
            plane(group=1, base_address=1 << 22, pool_offset=BPC * 256),
            plane(group=2, base_address=1 << 23),
        ],
        num_groups=3,
    )
    assert layout.pool_shared_groups == ((0, 2),)
    # Row 4 is used by all three groups: only groups 0 and 2 clash.
    pairs = [[1, 4, 0], [2, 4, 1], [3, 4, 1]]
    with pytest.raises(ValueError, match="pool row 4 is written by groups 0 and 2"):
        check(layout, pairs, [0, 1, 2, 3], Direction.TO_POOL)
    check(layout, [[1, 4, 0], [2, 4, 1], [3, 5, 1]], [0, 1, 2, 3], Direction.TO_POOL)


@pytest.mark.parametrize(
    "ids",
    [[3, 0, 7], np.array([3, 0, 7], dtype=np.int32), torch.tensor([3, 0, 7]), (3, 0, 7)],
    ids=["list-of-ints", "int32-array", "tensor", "tuple"],
)
def test_a_job_spec_takes_ids_in_any_integer_form_as_read_only_int64(ids: Any) -> None:
    spec = JobSpec([ids], [ids])
    for array in (spec.gpu_blocks[0], spec.host_blocks[0]):
        assert array.dtype == np.int64 and array.tolist() == [3, 0, 7]
        assert not array.flags.writeable
    if isinstance(ids, list):
        ids[0] = 99  # the spec keeps its own copy
        assert spec.gpu_blocks[0].tolist() == [3, 0, 7]


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([1, -2], ValueError, "GPU block id -2 of group 0 is negative"),
        ([1, 1 << 63], ValueError, f"id {1 << 63} does not fit in a 64-bit signed id"),
        ([1, True], TypeError, "got bool True at index 1"),
        ([1, 2.0], TypeError, "must hold integer ids"),
    ],
)
def test_a_list_of_ids_is_refused_naming_the_bad_id(ids: list, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        JobSpec([ids], [[0]])


@pytest.mark.parametrize(
    ("gpu", "host"),
    [
        ([[1, 2], [3]], [[0], [4]]),
        ([[], [3]], [[], [4]]),
        ([[1], [2]], [[0], (4,)]),
        ([[1, True]], [[0]]),
        ([[1, -2]], [[0]]),
        ([[1]], [[2**63]]),
        ([[1, 2.0]], [[0]]),
        ([[1]], [[0], [1]]),
        ([[np.int64(1)]], [[0]]),
        ([[1]], ["ab"]),
    ],
    ids=str,
)
def test_keyword_lists_make_the_spec_the_constructor_makes(gpu: Any, host: Any) -> None:
    """JobSpec.of's keyword lists (the submit path) give the spec JobSpec(...) gives, or
    its error: same arrays (int64, read-only) and first indices, same exception."""
    try:
        expected: JobSpec | BaseException = JobSpec(gpu, host)
    except (TypeError, ValueError) as error:
        expected = error
    if isinstance(expected, BaseException):
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            JobSpec.of(None, gpu_blocks=gpu, host_blocks=host)
        return
    made = JobSpec.of(None, gpu_blocks=gpu, host_blocks=host)
    assert made.first_block_index == expected.first_block_index
    for side in ("gpu_blocks", "host_blocks"):
        got, want = getattr(made, side), getattr(expected, side)
        assert len(got) == len(want)
        for array, reference in zip(got, want, strict=True):
            assert array.dtype == np.int64 and not array.flags.writeable
            assert np.array_equal(array, reference)
    gpu[0].append(7)  # the caller's list is not the spec's
    assert made.gpu_blocks[0].tolist() == expected.gpu_blocks[0].tolist()
