"""The per-plane path choice: remembered per group and block count, same answers.

``CrossoverPath`` keeps, per (direction, group), the winners of the group's planes for
each block count it has seen, instead of asking the crossover for every plane of every
job. The judge below is the rule itself, plane by plane: a plane of a group with blocks
in the job goes to the copier the crossover picks for its page size and that count;
one copier for all planes when only one is picked; the triton kernel when none is.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_offload.transfer.layout import CacheLayout, build_layout
from triton_offload.transfer.selection import Assignment, Crossover, CrossoverPath

PAGE_SIZES = (30, 64, 128, 528, 4096)
GRID_PAGES = (1, 2, 5, 16, 64, 256)


def judge(
    layout: CacheLayout, crossover: Crossover, direction: int, counts: list[int]
) -> Assignment:
    winners: list[str] = []
    for group, members in enumerate(layout.group_planes):
        for index in members:
            page = layout.planes[index].page_bytes
            winners.append(
                crossover.choose(direction, page, counts[group]) if counts[group] else ""
            )
    names = sorted({w for w in winners if w})
    if len(names) <= 1:
        return ((names[0] if names else "triton", None),)
    return tuple((name, tuple(i for i, w in enumerate(winners) if w == name)) for name in names)


def _layout(groups: list[list[list[int]]]) -> CacheLayout:
    caches = [
        [tuple(torch.empty(2, page, dtype=torch.uint8) for page in layer) for layer in layers]
        for layers in groups
    ]
    return build_layout(caches, num_groups=len(groups), blocks_per_chunk=1)


layers = st.lists(st.sampled_from(PAGE_SIZES), min_size=1, max_size=2)
groups_strategy = st.lists(st.lists(layers, min_size=0, max_size=4), min_size=1, max_size=4).filter(
    lambda groups: any(groups)
)


@st.composite
def crossovers(draw: st.DrawFn) -> Crossover:
    if draw(st.booleans()) and draw(st.booleans()):
        return Crossover(
            threshold={0: draw(st.sampled_from(PAGE_SIZES)), 1: draw(st.sampled_from(PAGE_SIZES))}
        )
    grid = {}
    for direction in (0, 1):
        points = draw(
            st.lists(
                st.tuples(st.sampled_from(PAGE_SIZES), st.sampled_from(GRID_PAGES)),
                min_size=1,
                max_size=8,
                unique=True,
            )
        )
        grid[direction] = {p: draw(st.sampled_from(("triton", "dma"))) for p in points}
    return Crossover(grid=grid)


@settings(max_examples=80, deadline=None)
@given(groups=groups_strategy, crossover=crossovers(), data=st.data())
def test_assignment_equals_the_plane_by_plane_rule(
    groups: list[list[list[int]]], crossover: Crossover, data: st.DataObject
) -> None:
    layout = _layout(groups)
    policy = CrossoverPath(layout, crossover, "plane")
    counts = st.lists(st.integers(0, 300), min_size=len(groups), max_size=len(groups))
    jobs = data.draw(st.lists(st.tuples(st.sampled_from((0, 1)), counts), min_size=1, max_size=12))
    for direction, job in jobs + jobs:  # the second pass answers from the memo and cache
        assert policy.assign(direction, job) == judge(layout, crossover, direction, job)


def test_a_count_in_another_bucket_changes_only_its_group() -> None:
    """Hand-checked: attention pages of 64 B, Mamba 30 B conv + 4096 B SSM; DMA for the
    4096-byte pages at 16 pages, for the 64-byte pages only at 256 pages (per direction)."""
    layout = _layout([[[64, 64]], [[30, 4096]]])
    grid = {(64, 16): "triton", (64, 256): "dma", (4096, 16): "dma", (30, 16): "triton"}
    policy = CrossoverPath(layout, Crossover(grid={0: grid, 1: {(64, 1): "dma"}}), "plane")
    assert policy.assign(0, [3, 1]) == (("dma", (3,)), ("triton", (0, 1, 2)))
    assert policy.assign(0, [300, 1]) == (("dma", (0, 1, 3)), ("triton", (2,)))
    assert policy.assign(0, [300, 0]) == (("dma", None),)
    assert policy.assign(0, [0, 0]) == (("triton", None),)
    assert policy.assign(1, [3, 1]) == (("dma", None),)
