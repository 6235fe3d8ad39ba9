"""Two independent references for load-side hits, shared by the tests.

``hit_is_valid`` / ``largest_valid_hit`` judge a hit from first principles (what a
prefill resumed at the hit end reads), not from the planner's code:

- A hit end ``H`` must exceed ``num_computed_tokens`` and not exceed ``num_tokens``;
  with any windowed group (sliding window, chunked local, Mamba) ``H <= num_tokens - 1``
  (the last prompt token is recomputed for its logits).
- Unbounded groups (full attention, MLA): every token in ``[computed, H)`` lies in a
  present chunk.
- Sliding window of ``w`` tokens (the token itself included): every token in
  ``[max(computed, H - w + 1), H)``; chunked local attention of chunk ``c``: every
  token in ``[max(computed, H - H mod c), H)``.
- Mamba: ``H`` is a multiple of its ``tokens_per_chunk`` and chunk ``H / tpc - 1`` (the
  state after token ``H - 1``) is present.
- A load moves whole chunks: a hit that ends inside a chunk of a windowed group loads
  the block of the first recomputed token, so that chunk is present too.
- EAGLE groups: the chunk after the one holding token ``H - 1`` is present as well (it
  is queried and popped: the draft KV of the hit's last position is rewritten).
- Only whole chunks (``i < num_tokens // tpc``) are ever present; chunks wholly below
  ``num_computed_tokens`` are on the GPU and need not be.

``vllm_stock_hit`` is a model of vLLM 0.33's ``_lookup_complete_chunks`` (synchronous
manager, every lookup a hit or a miss, no load caps, no partial tails), written from
reading that function: the Mamba round-down is applied once to the starting bound,
then groups cut the hit in turn (full attention first, then windowed groups widest
first), each refusing a hit shorter than one of its own chunks, with windowed groups
re-visited when a later group shrinks the hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from triton_offload import GroupKind, OffloadPlan


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _holds(row: Sequence[bool], chunk: int, full_chunks: int) -> bool:
    return chunk < full_chunks and chunk < len(row) and bool(row[chunk])


def hit_is_valid(
    plan: OffloadPlan,
    num_tokens: int,
    num_computed: int,
    present: Sequence[Sequence[bool]],
    hit_end: int,
) -> bool:
    """Whether resuming the prefill at ``hit_end`` restores exactly a cold prefill's state."""
    if hit_end <= num_computed or hit_end > num_tokens:
        return False
    if any(g.kind is not GroupKind.FULL_ATTENTION and g.kind is not GroupKind.MLA
           for g in plan.groups) and hit_end > num_tokens - 1:  # fmt: skip
        return False
    for group, row in zip(plan.groups, present, strict=True):
        spec = group.spec
        tpc = group.tokens_per_chunk
        full_chunks = num_tokens // tpc
        if spec.kind is GroupKind.MAMBA:
            if hit_end % tpc or not _holds(row, hit_end // tpc - 1, full_chunks):
                return False
            tokens: range = range(0)
        elif spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            tokens = range(max(num_computed, hit_end - spec.sliding_window + 1), hit_end)
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            tokens = range(
                max(num_computed, hit_end - hit_end % spec.attention_chunk_size), hit_end
            )
        else:
            tokens = range(num_computed, hit_end)
        # The chunks holding those tokens (token t lies in chunk t // tpc).
        chunks = set(range(tokens.start // tpc, (tokens.stop - 1) // tpc + 1)) if tokens else set()
        if spec.kind is not GroupKind.MAMBA and hit_end % tpc:
            chunks.add(hit_end // tpc)  # the chunk the hit ends inside is loaded whole
        if spec.is_eagle:
            chunks.add(cdiv(hit_end, tpc))
        on_gpu = num_computed // tpc
        if not all(_holds(row, c, full_chunks) for c in chunks if c >= on_gpu):
            return False
    return True


def largest_valid_hit(
    plan: OffloadPlan, num_tokens: int, num_computed: int, present: Sequence[Sequence[bool]]
) -> int:
    """Tokens beyond ``num_computed`` of the largest valid hit end (0: none), by brute force."""
    for hit_end in range(num_tokens, num_computed, -1):
        if hit_is_valid(plan, num_tokens, num_computed, present, hit_end):
            return hit_end - num_computed
    return 0


# ---------------------------------------------------------------- vLLM 0.33's rule


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
            self.window_chunks, cdiv(self.sliding_tokens - 1 + padding, self.tokens_per_chunk)
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
            window = cdiv(spec.sliding_window, tpc)
            groups.append(StockGroup(tpc, window, spec.is_eagle, spec.sliding_window))
        elif spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            groups.append(StockGroup(tpc, cdiv(spec.attention_chunk_size, tpc), spec.is_eagle))
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
            num_chunks = min(cdiv(query_max, tpc), num_keys)
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
