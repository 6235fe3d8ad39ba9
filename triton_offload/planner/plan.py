"""``plan_offload``: cache groups + parallel sizes -> an immutable ``OffloadPlan``.

Pure Python, no torch. The plan holds every per-group constant the store and load
sides need (span, chunk, window, alignment) plus the lookup's visit order, so the
hot path (``OffloadPlan.lookup``) does no planning work. Each rule is stated
where it is computed, with the bug it prevents.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from triton_offload.planner.groups import (
    GroupKind,
    GroupSpec,
    ParallelSpec,
    PlanningError,
    check_positive_int,
)
from triton_offload.planner.lookup import PresenceRow, lookup_hit_tokens, reachable_chunks

__all__ = ["GroupPlan", "OffloadPlan", "plan_offload"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupPlan:
    """The offload constants of one cache group.

    ``tokens_per_block`` is the span of one GPU block across ranks (``block_size *
    dcp_size`` for DCP-sharded groups, ``block_size`` otherwise);
    ``tokens_per_chunk = tokens_per_block * blocks_per_chunk`` is the offload unit.
    ``sliding_window_size_in_chunks`` is None for unbounded kinds (full attention,
    MLA), ``ceil(window / tokens_per_chunk)`` for sliding-window and chunked-local
    attention, and 1 for Mamba (only the state at the hit end matters).
    ``alignment_chunk_count`` is this group's chunks per aligned segment, or None
    when every chunk is worth storing.
    """

    spec: GroupSpec
    tokens_per_block: int
    tokens_per_chunk: int
    sliding_window_size_in_chunks: int | None
    alignment_chunk_count: int | None

    @property
    def kind(self) -> GroupKind:
        return self.spec.kind

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def is_eagle(self) -> bool:
        return self.spec.is_eagle

    @property
    def is_windowed(self) -> bool:
        return self.sliding_window_size_in_chunks is not None

    def first_needed_token(self, hit_end: int) -> int:
        """First token whose cached data the first recomputed token (``hit_end``) reads.

        Unbounded kinds read the whole prefix (0); a sliding window of ``W`` tokens
        (the token itself included) reads ``[hit_end - W + 1, hit_end)``; chunked
        local attention of chunk ``C`` reads back to the start of its local chunk;
        Mamba reads only the state after token ``hit_end - 1``.
        """
        spec = self.spec
        if spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            return max(0, hit_end - spec.sliding_window + 1)
        if spec.kind is GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            return hit_end - hit_end % spec.attention_chunk_size
        if spec.kind is GroupKind.MAMBA:
            return max(0, hit_end - 1)
        return 0

    def needed_chunks(self, hit_end: int) -> tuple[int, int]:
        """Chunks ``[lo, top)`` of this group a prefill resumed at ``hit_end`` reads.

        ``top = ceil(hit_end / tokens_per_chunk)``: a hit that ends inside a chunk takes
        that chunk whole. Unbounded kinds read every chunk from 0. A windowed group
        reads the chunks holding the tokens from :meth:`first_needed_token` on: a
        sliding window of ``W`` tokens needs ``ceil((W - 1) / tokens_per_chunk)`` chunks
        before a hit on its grid (one more off it, when the window starts early in a
        chunk), never more, so a hit is not refused for a chunk no token of the window
        lies in; chunked local attention reads back to its local chunk's start (nothing
        at a local-chunk boundary on the grid); Mamba reads the one chunk whose state is
        the one after token ``hit_end - 1``. The lookup checks exactly these chunks
        (plus the chunk after them for an EAGLE group); a load moves exactly these.
        """
        tpc = self.tokens_per_chunk
        top = -(-hit_end // tpc)
        if self.sliding_window_size_in_chunks is None:
            return 0, top
        lo = self.first_needed_token(hit_end) // tpc
        if hit_end % tpc:
            # A hit inside a chunk loads the block of the first recomputed token, so
            # that chunk is read even when the attention reaches no token before it:
            # vLLM 0.33 loads every allocated block up to that one, and asserts when
            # its chunk is not a whole one of the prompt (tests/vllm/test_connector_hit_rule.py).
            lo = min(lo, top - 1)
        return max(0, min(lo, top)), top

    def storable_chunk_count(self, num_tokens: int, *, num_prompt_tokens: int | None = None) -> int:
        """Chunks of this group worth considering for a store after ``num_tokens`` tokens.

        Only full chunks: ``num_tokens // tokens_per_chunk`` (a partial chunk is never
        stored: its key would name tokens that do not exist yet). An EAGLE group drops
        its newest chunk while decoding (``num_tokens > num_prompt_tokens``): the draft
        KV of the last accepted position can still be rewritten after a rejected draft
        token. During prefill that chunk is final and counts.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        count = num_tokens // self.tokens_per_chunk
        decoding = num_prompt_tokens is not None and num_tokens > num_prompt_tokens
        if self.is_eagle and decoding:
            count = max(0, count - 1)
        return count


@dataclass(frozen=True)
class OffloadPlan:
    """Everything the store and load sides need, computed once per model.

    ``alignment_tokens``: the unbounded groups' shared chunk (loads end on its
    boundaries), or None when there is none or they disagree. ``mamba_align_tokens``:
    the chunk of the Mamba groups in ``align``/``all`` mode, or None.
    """

    groups: tuple[GroupPlan, ...]
    blocks_per_chunk: int
    alignment_tokens: int | None
    mamba_align_tokens: int | None
    parallel: ParallelSpec
    # Lookup visit order, derived once here so lookups do no sorting: unbounded groups
    # in index order, then windowed groups widest window first (ties by index).
    unbounded_group_order: tuple[int, ...] = field(init=False, repr=False, compare=False)
    windowed_group_order: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # The smallest hit worth loading: every group must gain at least one chunk.
    max_tokens_per_chunk: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unbounded = tuple(i for i, g in enumerate(self.groups) if not g.is_windowed)
        windowed = sorted(
            (i for i, g in enumerate(self.groups) if g.is_windowed),
            key=lambda i: -(self.groups[i].sliding_window_size_in_chunks or 0),
        )
        object.__setattr__(self, "unbounded_group_order", unbounded)
        object.__setattr__(self, "windowed_group_order", tuple(windowed))
        object.__setattr__(
            self, "max_tokens_per_chunk", max(g.tokens_per_chunk for g in self.groups)
        )

    def _group(self, group_index: int) -> GroupPlan:
        if isinstance(group_index, bool) or not isinstance(group_index, int):
            raise TypeError(f"group_index must be an int, got {group_index!r}")
        if not 0 <= group_index < len(self.groups):
            raise ValueError(f"group_index {group_index} out of range [0, {len(self.groups)})")
        return self.groups[group_index]

    def storable_chunk_count(
        self, group_index: int, num_tokens: int, *, num_prompt_tokens: int | None = None
    ) -> int:
        """See :meth:`GroupPlan.storable_chunk_count`."""
        return self._group(group_index).storable_chunk_count(
            num_tokens, num_prompt_tokens=num_prompt_tokens
        )

    def store_reachable_chunks(self, group_index: int, storable_chunk_count: int) -> list[int]:
        """The chunks of group ``group_index`` worth storing, out of the first
        ``storable_chunk_count`` (see
        :func:`triton_offload.planner.lookup.is_store_reachable_chunk`)."""
        group = self._group(group_index)
        return reachable_chunks(
            storable_chunk_count,
            group.alignment_chunk_count,
            group.sliding_window_size_in_chunks,
            group.is_eagle,
        )

    def lookup(
        self,
        num_tokens: int,
        num_computed_tokens: int,
        present: Sequence[PresenceRow],
        *,
        max_hit_end: int | None = None,
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` that may be loaded from the pool.

        ``present[g]`` holds one bool per chunk of group ``g`` from chunk 0 (does the
        pool hold it); missing trailing entries count as absent. A ``list``/``tuple`` of
        bools or a ``bytes``/``bytearray`` of 0/1 takes the fast C-level scans. Values
        must be bools or 0/1: anything else (``2``, ``"0"``, ``None``) raises TypeError
        naming ``present[g][i]``, and a row that is a string or ``None`` one naming
        ``present[g]``. Returns ``hit_end - num_computed_tokens`` for the largest valid
        hit end, 0 when there is none beyond ``num_computed_tokens``.
        ``max_hit_end`` caps the hit end (an engine's load budget). The algorithm is
        :func:`triton_offload.planner.lookup.lookup_hit_tokens`.
        """
        return lookup_hit_tokens(
            self, num_tokens, num_computed_tokens, present, max_hit_end=max_hit_end
        )

    def describe(self, prompt_tokens: int | None = None, *, max_ranges: int = 6) -> str:
        """A text table of the plan; with ``prompt_tokens``, each group's storable and
        store-reachable chunks for a prompt of that length (ranges, truncated)."""
        headers = ["#", "group", "kind", "block", "span", "chunk", "window", "align", "eagle"]
        if prompt_tokens is not None:
            headers += ["storable", "reachable chunks"]
        rows: list[list[str]] = []
        for index, group in enumerate(self.groups):
            window = group.sliding_window_size_in_chunks
            align = group.alignment_chunk_count
            row = [
                str(index),
                group.spec.label,
                group.kind.value
                + (f"/{group.spec.mamba_cache_mode}" if group.kind is GroupKind.MAMBA else ""),
                str(group.block_size),
                str(group.tokens_per_block),
                str(group.tokens_per_chunk),
                "-" if window is None else str(window),
                "-" if align is None else str(align),
                "yes" if group.is_eagle else "no",
            ]
            if prompt_tokens is not None:
                storable = group.storable_chunk_count(prompt_tokens)
                chunks = self.store_reachable_chunks(index, storable)
                row += [str(storable), _format_ranges(chunks, max_ranges)]
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        parallel = self.parallel
        lines.append("")
        lines.append(
            f"parallel: tp={parallel.tp_size} dcp={parallel.dcp_size} pcp={parallel.pcp_size}"
            f"  blocks_per_chunk={self.blocks_per_chunk}"
        )
        lines.append(f"alignment_tokens: {_or_dash(self.alignment_tokens)}")
        lines.append(f"mamba_align_tokens: {_or_dash(self.mamba_align_tokens)}")
        order = [self.groups[i].spec.label for i in self.unbounded_group_order]
        order += [self.groups[i].spec.label for i in self.windowed_group_order]
        lines.append(f"lookup order: {' -> '.join(order)}")
        return "\n".join(lines)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _format_ranges(chunks: Sequence[int], max_ranges: int) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``; past ``max_ranges`` ranges, ``",..."``
    and the total count."""
    if not chunks:
        return "none"
    ranges: list[str] = []
    first = previous = chunks[0]
    total_ranges = 0
    for chunk in [*chunks[1:], None]:
        if chunk is not None and chunk == previous + 1:
            previous = chunk
            continue
        total_ranges += 1
        if len(ranges) < max_ranges:
            ranges.append(str(first) if first == previous else f"{first}-{previous}")
        if chunk is not None:
            first = previous = chunk
    text = ",".join(ranges)
    if total_ranges > max_ranges:
        text += f",... ({len(chunks)} chunks)"
    return text


def _window_in_chunks(spec: GroupSpec, tokens_per_chunk: int) -> int | None:
    if spec.kind is GroupKind.MAMBA:
        return 1  # only the state at the hit end is read
    window = spec.window_tokens
    return None if window is None else _cdiv(window, tokens_per_chunk)


def _alignment_chunk_count(
    alignment_tokens: int | None, tokens_per_chunk: int, window: int | None
) -> int | None:
    """Chunks of a windowed group per aligned segment, or None (store every chunk).

    None when there is no alignment, when this group's chunk is not smaller than
    the alignment, when the alignment is not a whole number of this group's chunks
    (segments would not end where loads end, and trimming would drop chunks a hit
    needs), or when the window already covers a whole segment (nothing to trim).
    """
    if alignment_tokens is None or window is None:
        return None
    if tokens_per_chunk >= alignment_tokens or alignment_tokens % tokens_per_chunk:
        return None
    per_segment = alignment_tokens // tokens_per_chunk
    if window >= per_segment:
        return None
    return per_segment


def plan_offload(
    groups: Iterable[GroupSpec],
    parallel: ParallelSpec = ParallelSpec(),  # noqa: B008 - frozen, shared safely
    *,
    blocks_per_chunk: int = 1,
) -> OffloadPlan:
    """Compute the offload plan of a model's cache groups.

    Per group: its span (``block_size * dcp_size`` tokens when DCP-sharded, as every
    attention kind is by default; ``block_size`` for replicated Mamba state), its chunk
    (span x ``blocks_per_chunk``), its window in chunks and its alignment count; for
    the plan, the alignment and Mamba grids and the lookup's visit order.

    Raises ``TypeError``/``ValueError`` (``PlanningError`` for inconsistent groups)
    naming the bad field and value: an empty group list, a non-positive
    ``blocks_per_chunk``, Mamba ``align``/``all`` groups whose chunks disagree.
    """
    specs = tuple(groups)
    if not specs:
        raise ValueError("groups is empty: a plan needs at least one cache group")
    for index, spec in enumerate(specs):
        if not isinstance(spec, GroupSpec):
            raise TypeError(f"groups[{index}] must be a GroupSpec, got {spec!r}")
    if not isinstance(parallel, ParallelSpec):
        raise TypeError(f"parallel must be a ParallelSpec, got {parallel!r}")
    check_positive_int("blocks_per_chunk", blocks_per_chunk)

    spans: list[tuple[int, int, int | None]] = []
    for spec in specs:
        # DCP interleaves attention KV across ranks, so one block covers dcp_size times
        # more of the sequence; Mamba state is replicated, and scaling its span by DCP was
        # vLLM's DCP/Mamba span bug (keys pointing at the wrong recurrent state).
        tokens_per_block = spec.block_size * (parallel.dcp_size if spec.is_dcp_sharded else 1)
        tokens_per_chunk = tokens_per_block * blocks_per_chunk
        spans.append(
            (tokens_per_block, tokens_per_chunk, _window_in_chunks(spec, tokens_per_chunk))
        )

    unbounded_chunks = {tpc for (_, tpc, window) in spans if window is None}
    alignment_tokens = unbounded_chunks.pop() if len(unbounded_chunks) == 1 else None

    mamba_align_tokens: int | None = None
    mamba_align_group = ""
    for index, (spec, (_, tokens_per_chunk, _)) in enumerate(zip(specs, spans, strict=True)):
        if not spec.requires_mamba_alignment:
            continue
        if mamba_align_tokens is not None and mamba_align_tokens != tokens_per_chunk:
            raise PlanningError(
                f"Mamba groups in align/all mode disagree on their chunk: {mamba_align_group} "
                f"has {mamba_align_tokens} tokens, group {index} ({spec.label!r}) has "
                f"{tokens_per_chunk}; a hit cannot end on both grids"
            )
        mamba_align_tokens = tokens_per_chunk
        mamba_align_group = f"group {index} ({spec.label!r})"

    plans = tuple(
        GroupPlan(
            spec=spec,
            tokens_per_block=tokens_per_block,
            tokens_per_chunk=tokens_per_chunk,
            sliding_window_size_in_chunks=window,
            alignment_chunk_count=_alignment_chunk_count(
                alignment_tokens, tokens_per_chunk, window
            ),
        )
        for spec, (tokens_per_block, tokens_per_chunk, window) in zip(specs, spans, strict=True)
    )
    return OffloadPlan(
        groups=plans,
        blocks_per_chunk=blocks_per_chunk,
        alignment_tokens=alignment_tokens,
        mamba_align_tokens=mamba_align_tokens,
        parallel=parallel,
    )
