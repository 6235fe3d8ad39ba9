"""Planner hot path: ``OffloadPlan.lookup`` on a 128k-token request.

The scheduler calls the lookup for every waiting request on every step, so it has
to cost well under a millisecond for a long prompt. Geometry: 131072 tokens,
three groups of 16-token chunks (full attention, a 1024-token sliding window,
Mamba in align mode) -> 8192 chunks per group. Measure with
``python -m pytest bench/suites/bench_planner.py --benchmark-enable``; by default the suite
runs each case once as a smoke test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from triton_offload import GroupSpec, OffloadPlan, plan_offload

NUM_TOKENS = 128 * 1024


def hybrid_plan() -> OffloadPlan:
    return plan_offload(
        [
            GroupSpec("full_attention", 16),
            GroupSpec("sliding_window", 16, sliding_window=1024),
            GroupSpec("mamba", 16, mamba_cache_mode="align"),
        ]
    )


def all_present(plan: OffloadPlan) -> list[list[bool]]:
    return [[True] * (NUM_TOKENS // g.tokens_per_chunk) for g in plan.groups]


def half_stored(plan: OffloadPlan) -> list[list[bool]]:
    """Full attention everywhere; the windowed groups hold only the first half, so
    their scans cross 4096 absent chunks before they find a window."""
    present = all_present(plan)
    for row in present[1:]:
        half = len(row) // 2
        row[half:] = [False] * (len(row) - half)
    return present


def _run(benchmark: Any, lookup: Callable[..., int], present: Sequence[Sequence[bool]]) -> int:
    return int(benchmark(lookup, NUM_TOKENS, 0, present))


def test_lookup_128k_full_hit_lists(benchmark: Any) -> None:
    plan = hybrid_plan()
    assert [NUM_TOKENS // g.tokens_per_chunk for g in plan.groups] == [8192] * 3
    # The last token is recomputed, the Mamba round-down takes the hit to 131056.
    assert _run(benchmark, plan.lookup, all_present(plan)) == NUM_TOKENS - 16


def test_lookup_128k_full_hit_bytes(benchmark: Any) -> None:
    plan = hybrid_plan()
    present = [bytearray(b"\x01" * (NUM_TOKENS // g.tokens_per_chunk)) for g in plan.groups]
    assert _run(benchmark, plan.lookup, present) == NUM_TOKENS - 16


def test_lookup_128k_windowed_groups_half_stored(benchmark: Any) -> None:
    plan = hybrid_plan()
    assert _run(benchmark, plan.lookup, half_stored(plan)) == NUM_TOKENS // 2


@pytest.mark.parametrize("computed", [0, NUM_TOKENS // 2])
def test_lookup_128k_prefix_gap(benchmark: Any, computed: int) -> None:
    """A hole in the full-attention prefix three quarters in: the prefix scan stops
    there, and the windowed groups re-check at the shorter hit."""
    plan = hybrid_plan()
    present = all_present(plan)
    present[0][6144] = False
    assert _run_computed(benchmark, plan, present, computed) == 6144 * 16 - computed


def _run_computed(
    benchmark: Any, plan: OffloadPlan, present: Sequence[Sequence[bool]], computed: int
) -> int:
    return int(benchmark(plan.lookup, NUM_TOKENS, computed, present))
