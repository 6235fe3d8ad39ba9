"""A model of vLLM 0.33's complete-chunk lookup rule, for comparisons and ``verify``.

Written from reading vLLM's ``OffloadingConnectorScheduler._lookup_complete_chunks``
(synchronous manager, every lookup a hit or a miss, no load caps, no partial tails):
the hit is rounded down to the Mamba grid once (``align`` mode only), before the
groups cut it in turn (full attention first, then windowed groups widest first), each
refusing a hit shorter than one of its own chunks, with windowed groups re-visited
when a later group shrinks the hit. A later cut by a group with a finer chunk grid can
leave the hit inside a Mamba chunk, which the Mamba check then accepts: the state
after that chunk's last token is restored at an earlier position. ``verify --inject
vllm-lookup`` runs it to show that failure; the test suite compares the planner with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from triton_offload.planner.groups import GroupKind
from triton_offload.planner.plan import OffloadPlan

__all__ = ["StockGroup", "stock_groups", "vllm_stock_hit"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StockGroup:
    """One group as vLLM's connector scheduler sees it."""

    tokens_per_chunk: int
    window_chunks: int | None  # None: full attention / MLA
    is_eagle: bool = False
    # Sliding-window specs only: window + extra retained tokens, for the wider first run
    # a hit inside a chunk needs.
    sliding_tokens: int | None = None

    def first_run_window(self, candidate_end: int) -> int:
        assert self.window_chunks is not None
        if self.sliding_tokens is None:
            return self.window_chunks
        padding = -candidate_end % self.tokens_per_chunk
        return max(
            self.window_chunks, _cdiv(self.sliding_tokens - 1 + padding, self.tokens_per_chunk)
        )


def stock_groups(plan: OffloadPlan) -> tuple[list[StockGroup], int | None]:
    """The plan's groups as vLLM 0.33 configures them, and its Mamba round-down size
    (only for Mamba in ``align`` mode: vLLM has no ``all`` mode and rounds nothing for
    ``none``)."""
    groups = []
    mamba_align: int | None = None
    for group in plan.groups:
        spec = group.spec
        tpc = group.tokens_per_chunk
        if spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            window = _cdiv(spec.sliding_window, tpc)
            groups.append(StockGroup(tpc, window, spec.is_eagle, spec.sliding_window))
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            groups.append(StockGroup(tpc, _cdiv(spec.attention_chunk_size, tpc), spec.is_eagle))
        elif spec.kind is GroupKind.MAMBA:
            groups.append(StockGroup(tpc, 1, spec.is_eagle))
            if spec.mamba_cache_mode == "align":
                mamba_align = tpc
        else:
            groups.append(StockGroup(tpc, None, spec.is_eagle))
    return groups, mamba_align


def _window_scan(row: Sequence[bool], required: int, initial: int) -> int:
    """End (in the scanned slice) of the last run of ``required`` hits from the end, the
    first run needing ``initial``; without one, the run at the slice's start."""
    consecutive = 0
    need = initial
    for index in range(len(row) - 1, -1, -1):
        if row[index]:
            consecutive += 1
        else:
            consecutive = 0
            need = required
        if consecutive == need:
            return index + need
    return consecutive


def vllm_stock_hit(
    groups: Sequence[StockGroup],
    mamba_align: int | None,
    num_tokens: int,
    num_computed: int,
    present: Sequence[Sequence[bool]],
) -> int:
    """Tokens beyond ``num_computed`` vLLM 0.33's complete-chunk lookup returns."""
    full = [i for i, g in enumerate(groups) if g.window_chunks is None]
    windowed = [i for i, g in enumerate(groups) if g.window_chunks is not None]
    windowed.sort(key=lambda i: groups[i].window_chunks or 0, reverse=True)
    max_hit = num_tokens
    if windowed:
        max_hit -= 1
        if mamba_align is not None:
            max_hit -= max_hit % mamba_align
    hit_tokens = 0
    to_visit: list[int] = full + windowed
    eagle_verified: set[int] = set()
    while to_visit:
        visited_window = False
        this_pass, to_visit = to_visit, []
        for index in this_pass:
            group = groups[index]
            tpc = group.tokens_per_chunk
            num_keys = num_tokens // tpc
            unverified = group.is_eagle and index not in eagle_verified
            max_hit = min(max_hit, num_keys * tpc)
            if max_hit - num_computed < tpc:
                return 0
            query_max = min(max_hit + tpc, num_keys * tpc) if unverified else max_hit
            num_chunks = min(_cdiv(query_max, tpc), num_keys)
            start = num_computed // tpc
            row = [
                c < len(present[index]) and bool(present[index][c])
                for c in range(start, num_chunks)
            ]
            if group.window_chunks is None:
                found = row.index(False) if False in row else len(row)
            else:
                required = group.window_chunks + int(unverified)
                candidate_end = min(max_hit, (num_chunks - int(unverified)) * tpc)
                initial = group.first_run_window(candidate_end) + int(unverified)
                found = _window_scan(row, required, initial)
            if found == 0:
                return 0
            if unverified:
                found -= 1
                eagle_verified.add(index)
            max_hit = min(max_hit, tpc * (start + found))
            new_hit = max_hit - num_computed
            if new_hit < tpc:
                return 0
            if new_hit < hit_tokens:
                if not group.is_eagle:
                    eagle_verified.clear()
                if visited_window and not to_visit:
                    to_visit = list(windowed)
            visited_window |= group.window_chunks is not None
            hit_tokens = new_hit
    return hit_tokens
