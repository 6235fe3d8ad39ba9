"""plan_offload: spans, windows, alignment and store reachability (hand-computed examples)."""

from __future__ import annotations

import dataclasses

import pytest

from triton_offload import (
    GroupKind,
    GroupSpec,
    OffloadPlan,
    ParallelSpec,
    is_store_reachable_chunk,
    plan_offload,
)
from triton_offload.planner.groups import PlanningError

FULL16 = GroupSpec("full_attention", 16)
MAMBA16_ALIGN = GroupSpec("mamba", 16, mamba_cache_mode="align")


def dcp_mamba_plan(**parallel: int) -> OffloadPlan:
    """The DCP/Mamba span geometry: full attention block 16 + Mamba block 16 (align)."""
    return plan_offload([FULL16, MAMBA16_ALIGN], ParallelSpec(**parallel))


def reachable(plan: OffloadPlan, group: int, storable: int) -> list[int]:
    """Reachable chunks through the scalar predicate (the vLLM-compatible signature)."""
    g = plan.groups[group]
    return [
        i
        for i in range(storable)
        if is_store_reachable_chunk(
            i, storable, g.alignment_chunk_count, g.sliding_window_size_in_chunks, g.is_eagle
        )
    ]


def test_dcp_mamba_dcp2_spans_alignment_and_reachable() -> None:
    plan = dcp_mamba_plan(tp_size=2, dcp_size=2)
    # DCP scales the attention span, never the replicated Mamba state (a Mamba span
    # scaled by DCP is the span bug the vLLM spec refuses at start-up).
    assert tuple(g.tokens_per_block for g in plan.groups) == (32, 16)
    assert tuple(g.tokens_per_chunk for g in plan.groups) == (32, 16)
    assert plan.alignment_tokens == 32
    assert plan.mamba_align_tokens == 16
    full, mamba = plan.groups
    assert (full.kind, full.sliding_window_size_in_chunks, full.alignment_chunk_count) == (
        GroupKind.FULL_ATTENTION,
        None,
        None,
    )
    assert (mamba.kind, mamba.sliding_window_size_in_chunks, mamba.alignment_chunk_count) == (
        GroupKind.MAMBA,
        1,
        2,
    )
    assert reachable(plan, 1, 4) == [1, 3]
    assert plan.store_reachable_chunks(1, 4) == [1, 3]
    assert plan.store_reachable_chunks(0, 2) == [0, 1]


def test_dcp_mamba_without_dcp_has_no_trim() -> None:
    plan = dcp_mamba_plan()
    assert tuple(g.tokens_per_block for g in plan.groups) == (16, 16)
    # The Mamba chunk equals the alignment: nothing to trim.
    assert plan.groups[1].alignment_chunk_count is None
    assert plan.store_reachable_chunks(1, 4) == [0, 1, 2, 3]


def test_dcp2_pcp2_same_spans_as_dcp2() -> None:
    """PCP and TP never scale spans; only DCP does, and only for sharded groups."""
    plan = dcp_mamba_plan(tp_size=4, dcp_size=2, pcp_size=2)
    assert plan.parallel == ParallelSpec(tp_size=4, dcp_size=2, pcp_size=2)
    assert tuple(g.tokens_per_block for g in plan.groups) == (32, 16)
    assert plan.groups[1].alignment_chunk_count == 2
    assert plan.store_reachable_chunks(1, 6) == [1, 3, 5]
    assert dcp_mamba_plan(pcp_size=2).groups[0].tokens_per_block == 16


def test_dcp_override_per_group() -> None:
    plan = plan_offload(
        [
            GroupSpec("full_attention", 16, dcp_sharded=False),
            GroupSpec("mamba", 16, dcp_sharded=True),
        ],
        ParallelSpec(tp_size=4, dcp_size=4),
    )
    assert tuple(g.tokens_per_block for g in plan.groups) == (16, 64)


def test_sliding_window_example() -> None:
    """Full attention block 16 + sliding window block 4 (window 8 tokens)."""
    plan = plan_offload([FULL16, GroupSpec("sliding_window", 4, sliding_window=8)])
    swa = plan.groups[1]
    assert swa.tokens_per_chunk == 4
    assert swa.sliding_window_size_in_chunks == 2
    assert swa.alignment_chunk_count == 4
    assert plan.alignment_tokens == 16
    assert plan.mamba_align_tokens is None
    storable = plan.storable_chunk_count(1, 33)
    assert storable == 8
    assert plan.store_reachable_chunks(1, storable) == [2, 3, 6, 7]
    assert reachable(plan, 1, storable) == [2, 3, 6, 7]
    assert plan.store_reachable_chunks(0, plan.storable_chunk_count(0, 33)) == [0, 1]
    # A partial last segment keeps its own tail: 10 storable -> segment [8, 10).
    assert plan.store_reachable_chunks(1, 10) == [2, 3, 6, 7, 8, 9]


def test_needed_chunks_of_a_hit() -> None:
    """The chunks a resume at ``hit_end`` reads (what the lookup checks, what a load moves)."""
    plan = plan_offload([FULL16, GroupSpec("sliding_window", 4, sliding_window=8), MAMBA16_ALIGN])
    full, swa, mamba = plan.groups
    assert full.needed_chunks(32) == (0, 2)
    assert full.needed_chunks(33) == (0, 3)  # the chunk holding token 32 is taken whole
    # On the grid: the window's 2 chunks. Off it (33): token 33 reads tokens 26..32,
    # chunks 6..8, one chunk more than the window.
    assert swa.needed_chunks(32) == (6, 8)
    assert swa.needed_chunks(33) == (6, 9)
    assert swa.needed_chunks(4) == (0, 1)  # a window reaching before token 0 is clipped
    assert mamba.needed_chunks(32) == (1, 2)  # only the state after token 31


def test_blocks_per_chunk_scales_chunks_not_spans() -> None:
    plan = plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("sliding_window", 4, sliding_window=20)],
        ParallelSpec(tp_size=2, dcp_size=2),
        blocks_per_chunk=2,
    )
    full, swa = plan.groups
    assert (full.tokens_per_block, full.tokens_per_chunk) == (32, 64)
    assert (swa.tokens_per_block, swa.tokens_per_chunk) == (8, 16)
    assert plan.blocks_per_chunk == 2
    assert plan.alignment_tokens == 64
    assert swa.sliding_window_size_in_chunks == 2  # ceil(20 / 16)
    assert swa.alignment_chunk_count == 4
    assert plan.store_reachable_chunks(1, 7) == [2, 3, 5, 6]


def test_window_in_chunks_rounds_up_and_chunked_local() -> None:
    plan = plan_offload(
        [
            GroupSpec("mla", 64),
            GroupSpec("sliding_window", 16, sliding_window=33),
            GroupSpec("chunked_local", 16, attention_chunk_size=8192),
            GroupSpec("mamba", 32),
        ]
    )
    assert [g.sliding_window_size_in_chunks for g in plan.groups] == [None, 3, 512, 1]
    # 64 / 16 = 4 chunks per segment: the window of 3 trims; 512 covers a segment.
    # A 32-token Mamba chunk is 2 per segment and its window is 1.
    assert [g.alignment_chunk_count for g in plan.groups] == [None, 4, None, 2]
    assert plan.unbounded_group_order == (0,)
    assert plan.windowed_group_order == (2, 1, 3)  # widest window first


def test_no_alignment_when_unbounded_chunks_disagree_or_absent() -> None:
    disagree = plan_offload(
        [
            GroupSpec("full_attention", 16),
            GroupSpec("mla", 32),
            GroupSpec("sliding_window", 4, sliding_window=4),
        ]
    )
    assert disagree.alignment_tokens is None
    assert disagree.groups[2].alignment_chunk_count is None
    windowed_only = plan_offload([GroupSpec("sliding_window", 4, sliding_window=4)])
    assert windowed_only.alignment_tokens is None
    assert windowed_only.store_reachable_chunks(0, 3) == [0, 1, 2]


def test_no_trim_when_alignment_not_a_whole_number_of_chunks() -> None:
    """Segments of 2 x 20 tokens would end at 40, 80, ... while loads end at 48, 96."""
    plan = plan_offload([GroupSpec("full_attention", 48), GroupSpec("mamba", 20)])
    assert plan.alignment_tokens == 48
    assert plan.groups[1].alignment_chunk_count is None


def test_eagle_extends_reachable_tail_and_drops_newest_while_decoding() -> None:
    plan = plan_offload(
        [FULL16, GroupSpec("sliding_window", 4, sliding_window=4, is_eagle=True)],
    )
    eagle = plan.groups[1]
    assert eagle.is_eagle
    assert (eagle.sliding_window_size_in_chunks, eagle.alignment_chunk_count) == (1, 4)
    assert plan.store_reachable_chunks(1, 8) == [2, 3, 6, 7]  # tail of w + 1 = 2
    assert plan.storable_chunk_count(1, 33, num_prompt_tokens=33) == 8  # prefill
    assert plan.storable_chunk_count(1, 33, num_prompt_tokens=20) == 7  # decoding
    assert plan.storable_chunk_count(0, 33, num_prompt_tokens=20) == 2  # not EAGLE


def test_mamba_align_tokens_from_align_and_all_only() -> None:
    assert plan_offload([GroupSpec("mamba", 16)]).mamba_align_tokens is None
    both = plan_offload(
        [
            GroupSpec("mamba", 16, mamba_cache_mode="align"),
            GroupSpec("mamba", 16, mamba_cache_mode="all"),
            GroupSpec("mamba", 64),  # mode none does not take part
        ],
        blocks_per_chunk=2,
    )
    assert both.mamba_align_tokens == 32


def test_mamba_align_disagreement_is_a_planning_error() -> None:
    groups = [
        GroupSpec("mamba", 16, mamba_cache_mode="align", name="conv"),
        GroupSpec("mamba", 32, mamba_cache_mode="all", name="ssm"),
    ]
    with pytest.raises(
        PlanningError, match=r"group 0 \('conv'\) has 16 tokens, group 1 \('ssm'\) has 32"
    ):
        plan_offload(groups)
    # Also a ValueError, for callers that only know that.
    with pytest.raises(ValueError, match=r"disagree"):
        plan_offload(groups)
    # DCP can make equal block sizes disagree when only one group is sharded.
    with pytest.raises(PlanningError, match=r"has 16 tokens, .* has 32"):
        plan_offload(
            [
                GroupSpec("mamba", 16, mamba_cache_mode="align"),
                GroupSpec("mamba", 16, mamba_cache_mode="align", dcp_sharded=True),
            ],
            ParallelSpec(tp_size=2, dcp_size=2),
        )


def test_empty_group_list() -> None:
    with pytest.raises(ValueError, match=r"groups is empty"):
        plan_offload([])


@pytest.mark.parametrize("bpc", [0, -1])
def test_non_positive_blocks_per_chunk(bpc: int) -> None:
    with pytest.raises(ValueError, match=rf"blocks_per_chunk must be positive, got {bpc}"):
        plan_offload([FULL16], blocks_per_chunk=bpc)


def test_wrong_types_to_plan_offload() -> None:
    with pytest.raises(TypeError, match=r"blocks_per_chunk must be an int, got 2.0"):
        plan_offload([FULL16], blocks_per_chunk=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"groups\[1\] must be a GroupSpec, got 'mamba'"):
        plan_offload([FULL16, "mamba"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"parallel must be a ParallelSpec"):
        plan_offload([FULL16], 2)  # type: ignore[arg-type]


def test_plan_is_frozen_and_carries_specs() -> None:
    plan = dcp_mamba_plan(tp_size=2, dcp_size=2)
    assert plan.groups[1].spec is MAMBA16_ALIGN
    assert plan.groups[1].block_size == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.alignment_tokens = 7  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].tokens_per_chunk = 7  # type: ignore[misc]
    assert plan == dcp_mamba_plan(tp_size=2, dcp_size=2)


def test_reachability_bad_input() -> None:
    plan = dcp_mamba_plan(tp_size=2, dcp_size=2)
    with pytest.raises(ValueError, match=r"group_index 2 out of range \[0, 2\)"):
        plan.store_reachable_chunks(2, 4)
    with pytest.raises(ValueError, match=r"storable_chunk_count must be >= 0, got -1"):
        plan.store_reachable_chunks(1, -1)
    with pytest.raises(ValueError, match=r"chunk_index 4 out of range \[0, 4\)"):
        is_store_reachable_chunk(4, 4, 2, 1, False)
    with pytest.raises(ValueError, match=r"chunk_index must be >= 0, got -1"):
        is_store_reachable_chunk(-1, 4, 2, 1, False)
    with pytest.raises(ValueError, match=r"alignment_chunk_count=2 needs sliding_window_chunks"):
        is_store_reachable_chunk(0, 4, 2, None, False)
    with pytest.raises(ValueError, match=r"num_tokens must be a non-negative int, got -5"):
        plan.storable_chunk_count(0, -5)


def test_describe_lists_every_group() -> None:
    plan = dcp_mamba_plan(tp_size=2, dcp_size=2)
    text = plan.describe(prompt_tokens=64)
    lines = text.splitlines()
    assert lines[0].split() == [
        "#",
        "group",
        "kind",
        "block",
        "span",
        "chunk",
        "window",
        "align",
        "eagle",
        "storable",
        "reachable",
        "chunks",
    ]
    assert lines[2].split() == [
        "0",
        "full_attention",
        "full_attention",
        "16",
        "32",
        "32",
        "-",
        "-",
        "no",
        "2",
        "0-1",
    ]
    assert lines[3].split() == [
        "1",
        "mamba",
        "mamba/align",
        "16",
        "16",
        "16",
        "1",
        "2",
        "no",
        "4",
        "1,3",
    ]
    assert "alignment_tokens: 32" in text
    assert "mamba_align_tokens: 16" in text
    assert "dcp=2" in text


def test_describe_truncates_long_reachable_lists() -> None:
    plan = plan_offload([FULL16, GroupSpec("sliding_window", 4, sliding_window=8)])
    text = plan.describe(prompt_tokens=4096, max_ranges=3)
    assert "2-3,6-7,10-11,... (512 chunks)" in text
