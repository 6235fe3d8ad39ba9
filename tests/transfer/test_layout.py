"""Cache tensors -> planes: geometry, uint8 views and the plane-major pool row layout."""

from __future__ import annotations

import pytest
import torch

from triton_offload.transfer.layout import build_layout, pool_plane_view


def test_kv_tuple_and_mamba_planes_hand_computed() -> None:
    kv = torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16)  # (K/V, blocks, tokens, heads, dim)
    conv = torch.zeros(5, 3, 5, dtype=torch.float16)  # 30 bytes per block: not 16-aligned
    ssm = torch.zeros(5, 4, 33)  # 528 bytes per block
    layout = build_layout([[(kv[0], kv[1])], [(conv, ssm)]], num_groups=2, blocks_per_chunk=3)
    got = [
        (p.group, p.layer, p.index, p.block_stride, p.page_bytes, p.num_blocks, p.pool_offset)
        for p in layout.planes
    ]
    assert got == [
        (0, 0, 0, 128, 128, 5, 0),
        (0, 0, 1, 128, 128, 5, 384),
        (1, 0, 0, 30, 30, 5, 0),
        (1, 0, 1, 528, 528, 5, 96),  # 3 x 30 = 90 rounded up to 96
    ]
    assert layout.planes[0].base_address == kv.data_ptr()
    assert layout.planes[1].base_address == kv[1].data_ptr()
    assert layout.group_row_bytes == (768, 96 + 3 * 528)
    assert layout.row_bytes == 1680  # 1680 is already a multiple of 16
    assert layout.bytes_per_block == (256, 558)
    assert layout.group_num_blocks == (5, 5)


def test_padded_block_stride_and_views_share_memory() -> None:
    storage = torch.arange(6 * 40, dtype=torch.int32).reshape(6, 40)
    plane = storage[:, 4:36].unflatten(1, (4, 8))  # 128 bytes per block, stride 160 bytes
    layout = build_layout([[plane]], num_groups=1, blocks_per_chunk=1)
    (p,) = layout.planes
    assert (p.block_stride, p.page_bytes, p.num_blocks) == (160, 128, 6)
    assert p.base_address == plane.data_ptr()
    assert layout.row_bytes == 128
    for block in range(6):
        assert torch.equal(p.view[block], plane[block].contiguous().view(torch.uint8).flatten())
    p.view[2].fill_(0)  # the view writes into the cache
    assert int(plane[2].abs().sum()) == 0
    assert int(storage[2, :4].abs().sum()) != 0  # padding untouched


def test_row_bytes_is_the_largest_group_rounded_up() -> None:
    small = torch.zeros(4, 3, dtype=torch.uint8)
    big = torch.zeros(4, 21, dtype=torch.uint8)
    other = torch.zeros(4, 21, dtype=torch.uint8)  # two layers: two tensors
    layout = build_layout([[small], [big, other]], num_groups=2, blocks_per_chunk=2)
    assert [p.pool_offset for p in layout.planes] == [0, 0, 48]  # 42 -> 48
    assert layout.group_row_bytes == (6, 90)
    assert layout.row_bytes == 96


def test_groups_may_alias_memory() -> None:
    shared = torch.zeros(8, 16)
    layout = build_layout([[shared], [shared]], num_groups=2, blocks_per_chunk=1)
    assert layout.planes[0].base_address == layout.planes[1].base_address


def test_pool_plane_view_addresses_slots() -> None:
    a = torch.zeros(4, 3, dtype=torch.uint8)
    b = torch.zeros(4, 5, dtype=torch.uint8)
    layout = build_layout([[(a, b)]], num_groups=1, blocks_per_chunk=2)
    pool = torch.zeros(3, layout.row_bytes, dtype=torch.uint8)
    view = pool_plane_view(pool, layout.planes[1], 2)
    view[2, 1].fill_(7)
    expected = torch.zeros_like(pool)
    expected[2, 16 + 5 : 16 + 10] = 7  # plane 1 starts at 6 -> 16, slot 1 at +5
    assert torch.equal(pool, expected)


def test_wrong_group_count() -> None:
    with pytest.raises(ValueError, match="caches has 1 groups but the plan has 2"):
        build_layout([[torch.zeros(4, 4)]], num_groups=2, blocks_per_chunk=1)


def test_non_contiguous_block_region_names_layer() -> None:
    bad = torch.zeros(4, 8, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="group 1 layer 1 plane 0: the bytes of one block"):
        build_layout(
            [[torch.zeros(4, 4)], [torch.zeros(4, 4), bad]], num_groups=2, blocks_per_chunk=1
        )


def test_different_block_counts_in_group() -> None:
    with pytest.raises(ValueError, match="group 0 layer 1 plane 1 has 5 blocks"):
        build_layout(
            [[torch.zeros(4, 4), (torch.zeros(4, 2), torch.zeros(5, 2))]],
            num_groups=1,
            blocks_per_chunk=1,
        )


def test_overlapping_blocks_and_empty_group() -> None:
    base = torch.zeros(64)
    overlapping = base.as_strided((4, 8), (4, 1))
    with pytest.raises(ValueError, match="blocks would overlap"):
        build_layout([[overlapping]], num_groups=1, blocks_per_chunk=1)
    with pytest.raises(ValueError, match="caches hold no layer in any of the 1 groups"):
        build_layout([[]], num_groups=1, blocks_per_chunk=1)
    with pytest.raises(TypeError, match="group 0 layer 0"):
        build_layout([["kv"]], num_groups=1, blocks_per_chunk=1)
