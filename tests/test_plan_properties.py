"""Property-based tests of the planner over random geometries, prompts and pools.

The oracle below states what a hit *needs* in tokens, from the attention
definitions, not from the planner's code:

- unbounded groups (full attention, MLA): every token before the hit end;
- sliding window ``W``: tokens ``[end - W + 1, end)``; chunked local attention of
  ``C``: back to the start of the local chunk holding ``end``; plus, as the
  planner's window rule states it, the last ``w`` chunks before the hit end;
- Mamba: the hit ends on a chunk boundary and the chunk ending there is needed;
- EAGLE groups: also the chunk after the hit end (queried, then popped).

Needed tokens below ``num_computed_tokens // tokens_per_chunk`` chunks are on the
GPU already; every other needed chunk must be a full chunk of the prompt that the
pool holds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_offload import (
    GroupKind,
    GroupPlan,
    GroupSpec,
    OffloadPlan,
    ParallelSpec,
    is_store_reachable_chunk,
    plan_offload,
)
from triton_offload.groups import MAMBA_CACHE_MODES

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ strategies


@st.composite
def geometries(draw: st.DrawFn) -> OffloadPlan:
    # Mamba groups in align/all mode share one block size (otherwise a planning error).
    mamba_block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    specs: list[GroupSpec] = []
    for index in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(GroupKind)))
        block = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
        options: dict[str, object] = {"name": f"g{index}"}
        if kind is GroupKind.SLIDING_WINDOW:
            options["sliding_window"] = draw(st.integers(1, 80))
        elif kind is GroupKind.CHUNKED_LOCAL:
            options["attention_chunk_size"] = draw(st.integers(1, 80))
        elif kind is GroupKind.MAMBA:
            options["mamba_cache_mode"] = mode = draw(st.sampled_from(MAMBA_CACHE_MODES))
            if mode != "none":
                block = mamba_block
        options["is_eagle"] = draw(st.sampled_from([False, False, False, True]))
        if kind is not GroupKind.MAMBA and draw(st.integers(0, 5)) == 0:
            options["dcp_sharded"] = False
        specs.append(GroupSpec(kind, block, **options))  # type: ignore[arg-type]
    dcp = draw(st.sampled_from([1, 1, 2, 4]))
    parallel = ParallelSpec(
        tp_size=dcp * draw(st.sampled_from([1, 2, 8])),  # vLLM: TP is a multiple of DCP
        dcp_size=dcp,
        pcp_size=draw(st.sampled_from([1, 2])),
    )
    return plan_offload(specs, parallel, blocks_per_chunk=draw(st.sampled_from([1, 1, 2, 3])))


@st.composite
def aligned_geometries(draw: st.DrawFn) -> OffloadPlan:
    """Unbounded groups sharing one chunk that every other group's chunk divides."""
    block = draw(st.sampled_from([4, 8, 16]))
    dcp = draw(st.sampled_from([1, 2]))
    divisors = [d for d in range(1, block + 1) if block % d == 0]
    mamba_divisors = [d for d in range(1, block * dcp + 1) if block * dcp % d == 0]
    mamba_block = draw(st.sampled_from(mamba_divisors))
    specs = [GroupSpec(draw(st.sampled_from(["full_attention", "mla"])), block)]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["sliding_window", "chunked_local", "mamba", "mla"]))
        if kind == "mla":
            specs.append(GroupSpec("mla", block))
        elif kind == "mamba":
            mode = draw(st.sampled_from(MAMBA_CACHE_MODES))
            specs.append(GroupSpec("mamba", mamba_block, mamba_cache_mode=mode))
        else:
            window = draw(st.integers(1, 4 * block))
            field = "sliding_window" if kind == "sliding_window" else "attention_chunk_size"
            specs.append(GroupSpec(kind, draw(st.sampled_from(divisors)), **{field: window}))
    order = draw(st.permutations(range(len(specs))))
    return plan_offload(
        [specs[i] for i in order],
        ParallelSpec(tp_size=dcp, dcp_size=dcp),
        blocks_per_chunk=draw(st.sampled_from([1, 2])),
    )


@st.composite
def requests(draw: st.DrawFn, plan: OffloadPlan) -> tuple[int, int]:
    num_tokens = draw(st.integers(0, 700))
    chunk = draw(st.sampled_from([g.tokens_per_chunk for g in plan.groups]))
    computed = draw(
        st.one_of(
            st.just(0),
            st.integers(0, num_tokens),
            st.integers(0, num_tokens // chunk).map(lambda k: k * chunk),
        )
    )
    return num_tokens, computed


def random_presence(draw: st.DrawFn, plan: OffloadPlan, num_tokens: int) -> list[list[bool]]:
    rng: random.Random = draw(st.randoms(use_true_random=False))
    density = draw(st.sampled_from([0.3, 0.7, 0.9, 0.97, 1.0]))
    present = []
    for group in plan.groups:
        length = num_tokens // group.tokens_per_chunk + draw(st.integers(-2, 2))
        present.append([rng.random() < density for _ in range(max(0, length))])
    return present


def stored_reachable(plan: OffloadPlan, num_tokens: int) -> list[list[bool]]:
    """Simulate storing a prompt: exactly the store-reachable full chunks of each group."""
    present = []
    for index, group in enumerate(plan.groups):
        storable = group.storable_chunk_count(num_tokens)
        row = [False] * storable
        for chunk in plan.store_reachable_chunks(index, storable):
            row[chunk] = True
        present.append(row)
    return present


# ------------------------------------------------------------------ oracle


def needed_chunks(group: GroupPlan, hit_end: int, num_computed: int) -> set[int]:
    """Chunks of ``group`` a load ending at ``hit_end`` reads from the pool."""
    spec = group.spec
    tpc = group.tokens_per_chunk
    top = cdiv(hit_end, tpc)
    if spec.kind is GroupKind.SLIDING_WINDOW:
        assert spec.sliding_window is not None
        first_token = max(0, hit_end - spec.sliding_window + 1)
    elif spec.kind is GroupKind.CHUNKED_LOCAL:
        assert spec.attention_chunk_size is not None
        first_token = hit_end - hit_end % spec.attention_chunk_size
    elif spec.kind is GroupKind.MAMBA:
        first_token = hit_end - 1
    else:
        first_token = 0
    chunks = set(range(first_token // tpc, top + int(spec.is_eagle)))
    window = group.sliding_window_size_in_chunks
    if window is not None:
        chunks |= set(range(max(0, top - window), top))
    on_gpu = num_computed // tpc
    return {c for c in chunks if c >= on_gpu}


def check_hit(
    plan: OffloadPlan, num_tokens: int, num_computed: int, present: Sequence[Sequence[bool]]
) -> int:
    """Run the lookup and assert properties (a)/(c) and (b); returns the hit."""
    hit = plan.lookup(num_tokens, num_computed, present)
    assert hit >= 0
    if hit == 0:
        return hit
    end = num_computed + hit
    assert end <= num_tokens
    # (b) the hit end lands on the Mamba grid and leaves the last token to recompute.
    if plan.mamba_align_tokens is not None:
        assert end % plan.mamba_align_tokens == 0, (end, plan.mamba_align_tokens)
    if any(g.sliding_window_size_in_chunks is not None for g in plan.groups):
        assert end <= num_tokens - 1
    for index, group in enumerate(plan.groups):
        tpc = group.tokens_per_chunk
        assert hit >= tpc, "every group gains at least one chunk"
        if group.kind is GroupKind.MAMBA:
            assert end % tpc == 0, "a Mamba hit ends where a state is stored"
        full_chunks = num_tokens // tpc
        row = present[index]
        needed = needed_chunks(group, end, num_computed)
        for chunk in needed:
            assert chunk < full_chunks, (index, chunk, "not a full chunk of the prompt")
            assert chunk < len(row) and row[chunk], (index, chunk, "needed but absent")
        # The library's answer to "which chunks does this hit read" (what a load moves,
        # plus the chunk an EAGLE group pops) is the oracle's.
        lo, top = group.needed_chunks(end)
        reads = range(max(lo, num_computed // tpc), top + int(group.is_eagle))
        assert set(reads) == needed, (index, end, (lo, top), sorted(needed))
    return hit


# ------------------------------------------------------------------ reference


def reference_lookup(
    plan: OffloadPlan, num_tokens: int, num_computed: int, present: Sequence[Sequence[bool]]
) -> int:
    """Brute force over candidate hit ends: each group takes the largest end it can
    serve; repeat over all groups until nothing changes."""

    def holds(index: int, chunk: int) -> bool:
        row = present[index]
        return chunk < len(row) and bool(row[chunk])

    def serves(index: int, end: int) -> bool:
        group = plan.groups[index]
        tpc = group.tokens_per_chunk
        extra = int(group.is_eagle)
        top = cdiv(end, tpc)
        if top + extra > num_tokens // tpc:
            return False
        start = num_computed // tpc
        window = group.sliding_window_size_in_chunks
        if window is None:
            first = start
        elif end % tpc == 0:
            first = top - window
        else:
            first = top - max(window, top - group.first_needed_token(end) // tpc)
        return all(holds(index, c) for c in range(max(start, first), top + extra))

    def best_end(index: int, bound: int) -> int:
        group = plan.groups[index]
        tpc = group.tokens_per_chunk
        bound = min(bound, num_tokens // tpc * tpc)
        if group.kind is GroupKind.MAMBA:
            bound -= bound % tpc
        candidates = [bound] + [k * tpc for k in range((bound - 1) // tpc, 0, -1)]
        for end in candidates:
            if end <= num_computed:
                break
            if serves(index, end):
                return end
        return -1

    bound = num_tokens
    if any(g.sliding_window_size_in_chunks is not None for g in plan.groups):
        bound -= 1
        if plan.mamba_align_tokens is not None:
            bound -= bound % plan.mamba_align_tokens
    while True:
        previous = bound
        for index in range(len(plan.groups)):
            bound = best_end(index, bound)
            if bound < 0:
                return 0
        if bound == previous:
            break
    hit = bound - num_computed
    return hit if hit >= max(g.tokens_per_chunk for g in plan.groups) else 0


# ------------------------------------------------------------------ properties


@PROPERTY_SETTINGS
@given(data=st.data(), plan=geometries())
def test_demand_within_supply(data: st.DataObject, plan: OffloadPlan) -> None:
    """(a) Store exactly the reachable chunks of a prompt, look the prompt up again:
    every chunk the hit needs was called reachable and stored. (b) on the way."""
    num_tokens, computed = data.draw(requests(plan))
    stored = stored_reachable(plan, num_tokens)
    for index, row in enumerate(stored):
        group = plan.groups[index]
        for chunk, is_stored in enumerate(row):
            assert is_stored == is_store_reachable_chunk(
                chunk,
                len(row),
                group.alignment_chunk_count,
                group.sliding_window_size_in_chunks,
                group.is_eagle,
            )
    check_hit(plan, num_tokens, computed, stored)


@PROPERTY_SETTINGS
@given(data=st.data(), plan=geometries())
def test_hit_never_needs_an_absent_chunk(data: st.DataObject, plan: OffloadPlan) -> None:
    """(c) random pools: a hit never needs an absent chunk; and the fast scans agree
    with the brute-force reference for every presence container type."""
    num_tokens, computed = data.draw(requests(plan))
    present = random_presence(data.draw, plan, num_tokens)
    hit = check_hit(plan, num_tokens, computed, present)
    assert hit == reference_lookup(plan, num_tokens, computed, present)
    assert plan.lookup(num_tokens, computed, [tuple(r) for r in present]) == hit
    assert plan.lookup(num_tokens, computed, [bytes(r) for r in present]) == hit
    assert plan.lookup(num_tokens, computed, [_Plain(r) for r in present]) == hit


@PROPERTY_SETTINGS
@given(data=st.data(), plan=geometries())
def test_group_order_does_not_change_the_hit(data: st.DataObject, plan: OffloadPlan) -> None:
    num_tokens, computed = data.draw(requests(plan))
    present = random_presence(data.draw, plan, num_tokens)
    order = data.draw(st.permutations(range(len(plan.groups))))
    shuffled = plan_offload([plan.groups[i].spec for i in order], plan.parallel,
                            blocks_per_chunk=plan.blocks_per_chunk)  # fmt: skip
    assert shuffled.lookup(num_tokens, computed, [present[i] for i in order]) == plan.lookup(
        num_tokens, computed, present
    )


@PROPERTY_SETTINGS
@given(data=st.data(), plan=aligned_geometries())
def test_trimmed_store_keeps_every_aligned_hit(data: st.DataObject, plan: OffloadPlan) -> None:
    """Supply meets demand: for a prompt whose last token follows an alignment
    boundary, storing only the reachable chunks loads as much as storing all."""
    alignment = plan.alignment_tokens
    assert alignment is not None
    assert all(alignment % g.tokens_per_chunk == 0 for g in plan.groups)
    segments = data.draw(st.integers(1, 8))
    num_tokens = segments * alignment + 1
    everything = [[True] * (num_tokens // g.tokens_per_chunk) for g in plan.groups]
    trimmed = stored_reachable(plan, num_tokens)
    expected = segments * alignment
    assert plan.lookup(num_tokens, 0, everything) == expected
    assert check_hit(plan, num_tokens, 0, trimmed) == expected


class _Plain(Sequence[bool]):
    def __init__(self, values: Sequence[bool]) -> None:
        self._values = list(values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._values[index]
