"""OffloadPlan.lookup and the presence scans behind it (the load side)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from triton_offload import GroupSpec, OffloadPlan, ParallelSpec, plan_offload
from triton_offload.planner.lookup import (
    first_absent,
    hit_end_problem,
    last_present,
    lookup_hit_tokens,
)


def bits(count: int, present: Sequence[int]) -> list[bool]:
    return [i in present for i in range(count)]


class Plain(Sequence[bool]):
    """A presence sequence of no special type: exercises the generic scan path."""

    def __init__(self, values: Sequence[bool]) -> None:
        self._values = list(values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._values[index]


def as_types(values: list[bool]) -> list[Sequence[bool]]:
    return [values, tuple(values), bytes(values), bytearray(values), Plain(values)]


def dcp_mamba_plan() -> OffloadPlan:
    """The DCP/Mamba span geometry: full attention block 16 + Mamba block 16 (align)
    under TP=2, DCP=2 (spans 32 and 16 tokens)."""
    return plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, mamba_cache_mode="align")],
        ParallelSpec(tp_size=2, dcp_size=2),
    )


def swa_plan(*, is_eagle: bool = False, window: int = 8) -> OffloadPlan:
    return plan_offload(
        [
            GroupSpec("full_attention", 16),
            GroupSpec("sliding_window", 4, sliding_window=window, is_eagle=is_eagle),
        ]
    )


# ---------------------------------------------------------------- worked examples


def test_dcp_mamba_lookup_is_32() -> None:
    """63 -> 48 (Mamba round-down) -> full attention keeps 48 -> Mamba state at 32."""
    plan = dcp_mamba_plan()
    present = [bits(2, [0, 1]), bits(4, [1, 3])]
    for full, mamba in zip(as_types(present[0]), as_types(present[1]), strict=True):
        assert plan.lookup(64, 0, [full, mamba]) == 32
    # With the Mamba state at 48 stored too, the round-down still caps the hit at 48.
    assert plan.lookup(64, 0, [bits(2, [0, 1]), bits(4, [0, 1, 2, 3])]) == 48
    # Already computed 32 tokens: the state at 32 is on the GPU, nothing more to load.
    assert plan.lookup(64, 32, present) == 0


@pytest.mark.parametrize(("num_tokens", "expected"), [(32, 16), (33, 32)])
def test_mamba_only_round_down(num_tokens: int, expected: int) -> None:
    """Without the round-down a 32-token prompt would claim 31 tokens and restore the
    state of token 32 at position 31 (the boundary bug vLLM PR #44599 fixed)."""
    plan = plan_offload([GroupSpec("mamba", 16, mamba_cache_mode="align")])
    assert plan.lookup(num_tokens, 0, [[True, True]]) == expected


def test_sliding_window_example_lookup() -> None:
    plan = swa_plan()
    stored = [bits(2, [0, 1]), bits(8, [2, 3, 6, 7])]
    assert plan.lookup(33, 0, stored) == 32
    # The window before 32 is chunks 6 and 7: without chunk 6, the next full window
    # ends at 16 (chunks 2, 3).
    assert plan.lookup(33, 0, [bits(2, [0, 1]), bits(8, [2, 3, 7])]) == 16
    # A prompt of exactly 32 tokens recomputes its last token: the hit ends at 31,
    # inside SWA chunk 7, whose window [24, 31) lies in chunks 6-7.
    assert plan.lookup(32, 0, stored) == 31


def test_dcp_pcp_lookup_matches_dcp_only() -> None:
    dcp = dcp_mamba_plan()
    both = plan_offload(
        list(s.spec for s in dcp.groups), ParallelSpec(tp_size=2, dcp_size=2, pcp_size=2)
    )
    present = [bits(2, [0, 1]), bits(4, [1, 3])]
    assert both.lookup(64, 0, present) == dcp.lookup(64, 0, present) == 32


def test_blocks_per_chunk_lookup() -> None:
    """Block 16, two blocks per chunk, DCP 2: full-attention chunks of 64 tokens,
    Mamba chunks of 32."""
    plan = plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("mamba", 16, mamba_cache_mode="align")],
        ParallelSpec(tp_size=2, dcp_size=2),
        blocks_per_chunk=2,
    )
    assert [g.tokens_per_chunk for g in plan.groups] == [64, 32]
    assert plan.mamba_align_tokens == 32
    assert plan.groups[1].alignment_chunk_count == 2
    storable = plan.storable_chunk_count(1, 200)
    assert plan.store_reachable_chunks(1, storable) == [1, 3, 5]
    present = [bits(3, [0, 1, 2]), bits(6, [1, 3, 5])]
    # 199 -> 192; full attention keeps 192; Mamba state after chunk 5 ends at 192.
    assert plan.lookup(200, 0, present) == 192
    assert plan.lookup(200, 64, present) == 128
    # 128 tokens: 127 -> 96; Mamba chunk 2 (ends at 96) is not stored; chunk 1 is.
    assert plan.lookup(128, 0, present) == 64


# ---------------------------------------------------------------- rules


def test_prefix_scan_counts_from_computed_chunk() -> None:
    plan = plan_offload([GroupSpec("full_attention", 16)])
    # Chunk 0 is absent from the pool but already on the GPU.
    present = [bits(4, [1, 2])]
    assert plan.lookup(64, 0, present) == 0
    assert plan.lookup(64, 16, present) == 32
    # 20 computed tokens: the scan starts at chunk 1 and reloads it whole.
    assert plan.lookup(64, 20, present) == 28
    # A gap stops the prefix.
    assert plan.lookup(64, 16, [bits(4, [2, 3])]) == 0
    assert plan.lookup(64, 16, [bits(4, [1, 3])]) == 16
    # 40 computed tokens: the rest of chunk 2 is a valid 8-token hit (its load takes
    # the chunk whole); nothing beyond the computed tokens -> 0.
    assert plan.lookup(64, 40, [bits(4, [0, 1, 2])]) == 8
    assert plan.lookup(64, 48, [bits(4, [0, 1, 2])]) == 0


def test_no_windowed_group_keeps_last_token() -> None:
    plan = plan_offload([GroupSpec("full_attention", 16)])
    assert plan.lookup(64, 0, [[True] * 4]) == 64
    assert plan.lookup(70, 0, [[True] * 4]) == 64  # partial chunk never stored


def test_presence_shorter_than_request_means_absent() -> None:
    plan = swa_plan()
    assert plan.lookup(64, 0, [[True] * 4, [True] * 10]) == 40
    assert plan.lookup(64, 0, [[True] * 2, [True] * 16]) == 32
    assert plan.lookup(64, 0, [[], [True] * 16]) == 0


def test_windowed_groups_are_rechecked_until_stable() -> None:
    """A narrow group shrinks the hit below where the wide group checked its window."""
    plan = plan_offload(
        [
            GroupSpec("sliding_window", 4, sliding_window=12, name="wide"),
            GroupSpec("sliding_window", 4, sliding_window=4, name="narrow"),
        ]
    )
    assert plan.windowed_group_order == (0, 1)
    wide = bits(10, [2, 3, 4, 7, 8, 9])
    narrow = bits(10, [4, 5])
    # Wide: 40; narrow: 24; wide again at 24 needs chunks 3-5 (5 absent) -> 20;
    # narrow at 20 holds chunk 4 -> stable at 20. Without the re-check: 24.
    assert plan.lookup(41, 0, [wide, narrow]) == 20


def test_window_run_at_range_start_counts() -> None:
    """No full window run, but the GPU holds the chunks before the range."""
    plan = plan_offload([GroupSpec("sliding_window", 4, sliding_window=12)])
    present = [bits(10, [2, 3, 5])]
    assert plan.lookup(41, 8, present) == 16 - 8  # run [2, 4) from start chunk 2
    assert plan.lookup(41, 0, present) == 0  # from chunk 0, chunk 0 is absent


def test_hit_shorter_than_a_groups_chunk_is_kept() -> None:
    """A finer group cuts the hit below a coarser group's chunk: still valid (the
    coarse group loads the chunk holding the hit whole), and what vLLM's rule returns.
    Full attention chunk 64, sliding window 16 in 16-token chunks, 100 tokens: full
    attention allows 64, the window at 64 needs chunk 3 (absent), at 48 chunk 2."""
    plan = plan_offload(
        [GroupSpec("full_attention", 64), GroupSpec("sliding_window", 16, sliding_window=16)]
    )
    assert plan.lookup(100, 0, [[True], bits(6, [0, 1, 2, 4, 5])]) == 48
    # Under the sliding window's chunk, too: the window at 16 needs chunk 0 only.
    assert plan.lookup(100, 0, [[True], bits(6, [0, 4, 5])]) == 16


def test_window_needs_only_the_chunks_its_tokens_lie_in() -> None:
    """A 9-token window in 4-token chunks reads 8 tokens before a hit on the grid: two
    chunks, not ceil(9 / 4) = 3. Hit 16 reads tokens 8..15 (chunks 2, 3)."""
    plan = plan_offload([GroupSpec("sliding_window", 4, sliding_window=9)])
    assert plan.groups[0].sliding_window_size_in_chunks == 3
    assert plan.groups[0].needed_chunks(16) == (2, 4)
    assert plan.lookup(17, 0, [bits(4, [2, 3])]) == 16
    # Off the grid (17 tokens -> bound 16 is on it; 18 -> bound 17): tokens 9..16.
    assert plan.lookup(18, 0, [bits(4, [2, 3])]) == 16
    assert plan.lookup(21, 0, [bits(5, [2, 3, 4])]) == 20


def test_chunked_local_boundary_needs_no_chunk() -> None:
    """Chunked local attention resumed at a local-chunk boundary reads no earlier token."""
    plan = plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("chunked_local", 16, attention_chunk_size=32)]
    )
    assert plan.lookup(65, 0, [[True] * 4, bits(4, [])]) == 64
    assert plan.lookup(65, 0, [[True] * 4, bits(4, [3])]) == 64
    # At 48 (inside local chunk [32, 64)) chunk 2 would be needed: absent -> 32.
    assert plan.lookup(65, 0, [[True, True, True, False], bits(4, [])]) == 32


def test_mid_chunk_hit_needs_the_whole_window() -> None:
    """Full attention chunk 16 cuts the hit at 112, inside a 32-token SWA chunk; the
    window of token 112 (64 tokens) reaches token 49, in SWA chunk 1."""
    plan = plan_offload(
        [GroupSpec("full_attention", 16), GroupSpec("sliding_window", 32, sliding_window=64)]
    )
    full = bits(8, range(7))
    assert plan.lookup(129, 0, [full, bits(4, [1, 2, 3])]) == 112
    # Chunks 2-3 alone are the w=2 chunks ending at the hit but miss tokens 49-63.
    assert plan.lookup(129, 0, [full, bits(4, [0, 2, 3])]) == 32


def test_eagle_pops_one_chunk() -> None:
    plan = swa_plan(is_eagle=True, window=4)  # w = 1, tail w + 1 = 2
    storable = plan.storable_chunk_count(1, 33)
    stored = plan.store_reachable_chunks(1, storable)
    assert stored == [2, 3, 6, 7]
    # Run [6, 8) of w + 1 = 2 chunks, popped: the hit ends at chunk 7's start.
    assert plan.lookup(33, 0, [bits(2, [0, 1]), bits(8, stored)]) == 28
    # With chunk 8 stored (a longer prompt), the hit reaches the alignment boundary.
    assert plan.lookup(37, 0, [bits(2, [0, 1]), bits(9, [6, 7, 8])]) == 32
    # An unbounded EAGLE group also needs the chunk after its hit.
    eagle_full = plan_offload([GroupSpec("full_attention", 16, is_eagle=True)])
    assert eagle_full.lookup(64, 0, [[True] * 4]) == 48
    assert eagle_full.lookup(80, 0, [[True] * 5]) == 64
    assert eagle_full.lookup(80, 0, [[True] * 4]) == 48


def test_mamba_round_down_when_its_chunk_is_larger() -> None:
    """Mamba chunk 32 (mode none: no mamba_align_tokens) behind a 16-token attention
    chunk: the hit must still end where a state is stored."""
    plan = plan_offload([GroupSpec("full_attention", 16), GroupSpec("mamba", 32)])
    assert plan.mamba_align_tokens is None
    full = bits(8, [0, 1, 2])  # prefix up to 48
    assert plan.lookup(128, 0, [full, [True] * 4]) == 32


def test_max_hit_end_caps_the_hit() -> None:
    plan = dcp_mamba_plan()
    present = [[True] * 4, [True] * 8]
    assert plan.lookup(129, 0, present) == 128  # 128 is on both grids
    assert plan.lookup(129, 0, present, max_hit_end=70) == 64  # on the Mamba grid
    assert plan.lookup(129, 32, present, max_hit_end=40) == 0  # no state in (32, 40]
    with pytest.raises(ValueError, match="max_hit_end must be >= 0, got -1"):
        plan.lookup(129, 0, present, max_hit_end=-1)


def test_hit_end_problem_names_the_group() -> None:
    """The DCP/Mamba span geometry: full attention chunks 0-1, Mamba states at 32 and 64."""
    plan = dcp_mamba_plan()
    present = [bits(2, [0, 1]), bits(4, [1, 3])]
    assert hit_end_problem(plan, 64, 0, present, 32) is None
    assert hit_end_problem(plan, 64, 0, present, 40) == (
        "group 1 ('mamba', mamba): hit end 40 is off its 16-token chunk grid (no state "
        "stored there)"
    )
    assert "chunk it reads in [2, 3) is absent" in str(hit_end_problem(plan, 64, 0, present, 48))
    assert hit_end_problem(plan, 64, 0, present, 64) == (
        "hit end 64 exceeds 63 of 64 prompt tokens (the last one is recomputed for its logits)"
    )
    assert "does not pass the 32 computed" in str(hit_end_problem(plan, 64, 32, present, 32))


# ---------------------------------------------------------------- bad input


def test_lookup_bad_input() -> None:
    plan = dcp_mamba_plan()
    present = [[True] * 2, [True] * 4]
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0, got -1"):
        plan.lookup(-1, 0, present)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be >= 0, got -3"):
        plan.lookup(64, -3, present)
    with pytest.raises(ValueError, match=r"num_computed_tokens 65 exceeds num_tokens 64"):
        plan.lookup(64, 65, present)
    with pytest.raises(ValueError, match=r"present has 1 entries, expected one per group \(2\)"):
        plan.lookup(64, 0, present[:1])
    with pytest.raises(TypeError, match=r"num_tokens must be an int, got True"):
        plan.lookup(True, 0, present)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"num_computed_tokens must be an int, got 1.5"):
        plan.lookup(64, 1.5, present)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "row",
    [
        [True, True, 2, True],
        (True, True, 2, True),
        Plain([True, True, 2, True]),  # type: ignore[list-item]
        bytes([1, 1, 2, 1]),
        bytearray([1, 1, 2, 1]),
        [True, True, "0", True],
        [1, 1, -1, 1],
        [True, True, None, True],
        [True, True, [0], True],
    ],
)
def test_presence_values_other_than_bools_or_0_1_are_refused(row: Sequence[object]) -> None:
    # A truthy 2 counted as present in one scan and as absent in another, so such rows
    # gave answers that differ from the same rows as bools.
    plan = dcp_mamba_plan()
    with pytest.raises(TypeError, match=r"present\[1\]\[2\] is .*: presence values must be"):
        plan.lookup(64, 0, [[True, True], row])  # type: ignore[list-item]


@pytest.mark.parametrize("row", ["0000", "1111", None, 5, 1.5, {0: True}])
def test_presence_rows_that_are_not_sequences_of_bools_are_refused(row: object) -> None:
    plan = dcp_mamba_plan()
    with pytest.raises(TypeError, match=r"present\[0\] must be a sequence of bools"):
        plan.lookup(64, 0, [row, [True] * 4])  # type: ignore[list-item]


def test_presence_ints_0_and_1_answer_like_bools() -> None:
    plan = dcp_mamba_plan()
    rows = [bits(2, [0, 1]), bits(4, [1, 3])]
    as_ints = [[int(v) for v in row] for row in rows]
    assert plan.lookup(64, 0, as_ints) == plan.lookup(64, 0, rows) == 32  # type: ignore[arg-type]
    assert plan.lookup(64, 0, [tuple(r) for r in as_ints]) == 32  # type: ignore[misc]


def test_presence_numpy_bools_answer_like_bools() -> None:
    np = pytest.importorskip("numpy")
    plan = dcp_mamba_plan()
    rows = [bits(2, [0, 1]), bits(4, [1, 3])]
    assert plan.lookup(64, 0, [np.array(r, dtype=bool) for r in rows]) == 32
    assert plan.lookup(64, 0, [list(np.array(r, dtype=bool)) for r in rows]) == 32
    with pytest.raises(TypeError, match=r"present\[1\]\[3\] is .*2"):
        plan.lookup(64, 0, [rows[0], np.array([1, 0, 1, 2], dtype=np.int8)])


@pytest.mark.parametrize("present", [None, "11", b"\x01\x01", {0: [True], 1: [True]}])
def test_presence_must_be_a_sequence_of_rows(present: object) -> None:
    with pytest.raises(TypeError, match=r"present must be a sequence of presence rows"):
        dcp_mamba_plan().lookup(64, 0, present)  # type: ignore[arg-type]


def test_lookup_function_refuses_a_plan_of_another_type() -> None:
    with pytest.raises(TypeError, match=r"plan must be an OffloadPlan, got 'not a plan'"):
        lookup_hit_tokens("not a plan", 64, 0, [[True]])  # type: ignore[arg-type]


def test_empty_request() -> None:
    assert dcp_mamba_plan().lookup(0, 0, [[], []]) == 0


# ---------------------------------------------------------------- presence scans


@pytest.mark.parametrize("kind", range(5))
def test_scans_agree_across_container_types(kind: int) -> None:
    values = bits(40, [0, 1, 2, 5, 6, 7, 8, 20, 39])
    present = as_types(values)[kind]
    assert first_absent(present, 0, 40) == 3
    assert first_absent(present, 5, 40) == 9
    assert first_absent(present, 5, 9) == 9
    assert first_absent(present, 5, 5) == 5
    assert first_absent(present, 39, 45) == 40  # past the end is absent
    assert first_absent(present, 41, 45) == 41
    assert last_present(present, 0, 40) == 39
    assert last_present(present, 0, 39) == 20
    assert last_present(present, 21, 39) == 20  # none in range -> lo - 1
    assert last_present(present, 0, 100) == 39


def test_last_present_crosses_long_absent_stretch() -> None:
    values = [False] * 10_000
    values[3] = True
    assert last_present(values, 0, 10_000) == 3
    assert last_present(tuple(values), 4, 10_000) == 3


def test_a_hit_inside_a_chunk_needs_that_chunk_even_when_no_token_of_it_is_read() -> None:
    """The exact rule behind "the largest valid hit": a hit that ends inside a chunk of
    any group needs that chunk stored, even where attention reads none of its tokens
    (chunked local attention at a local-chunk boundary, a one-token window). vLLM 0.33
    loads the block holding the first recomputed token for every group whose block there
    is allocated, so it loads that chunk (tests/vllm/test_connector_hit_rule.py shows its scheduler
    asserting otherwise). Chunked local of 8 in 16-token chunks beside full attention in
    8-token chunks, 41 tokens: 40 is a local-chunk boundary but lies inside chunk 2
    (tokens 32..47), never whole in this prompt, so the hit is 32."""
    plan = plan_offload(
        [GroupSpec("full_attention", 8), GroupSpec("chunked_local", 16, attention_chunk_size=8)]
    )
    assert plan.groups[1].needed_chunks(40) == (2, 3)
    for row in as_types(bits(2, [0, 1])):
        assert plan.lookup(41, 0, [[True] * 5, row]) == 32
    problem = hit_end_problem(plan, 41, 0, [[True] * 5, bits(2, [0, 1])], 40)
    assert problem is not None and "a chunk it reads in [2, 3) is absent" in problem
    # With chunk 2 stored (a longer prompt, a load budget ending at 40) 40 is the hit.
    assert plan.lookup(49, 0, [[True] * 6, bits(3, [2])], max_hit_end=40) == 40
    # A one-token window in 3-token chunks, 8 tokens: 7 lies inside chunk 2 (not whole).
    window = plan_offload([GroupSpec("sliding_window", 3, sliding_window=1)])
    assert window.lookup(8, 0, [bits(2, [])]) == 6
