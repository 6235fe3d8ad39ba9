"""Store-side reachability and the load-side hit computation (each rule stated below).

Pure Python, no torch. The lookup runs on the scheduler's hot path once per
waiting request, so the presence scans below avoid per-element Python loops for
the common presence containers (``list``/``tuple`` of bools, ``bytes``/``bytearray``
of 0/1): they use C-level primitives (``list.index``, ``bytes.find``/``rfind``,
``in`` on short slices). ``lookup_hit_tokens`` first checks every row's values
(bools or 0/1, else TypeError); it packs a list/tuple row into bytes, one C pass
that both checks it and makes the scans ``find``/``rfind`` calls.

Chunk indices are per group, counted from chunk 0 of the request. A chunk that is
not in a presence sequence (index past its end) is absent.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, overload

from triton_offload.planner.groups import GroupKind, check_positive_int

if TYPE_CHECKING:
    from triton_offload.planner.plan import GroupPlan, OffloadPlan

#: The ``OffloadPlan`` attributes the hit computation reads.
_PLAN_FIELDS = ("groups", "unbounded_group_order", "windowed_group_order", "mamba_align_tokens")

# One group's presence: a bool per chunk from chunk 0. Lists/tuples of bools and
# bytes/bytearrays of 0/1 take the C-level scans; any other sequence works, slower.
PresenceRow = Sequence[bool] | bytes | bytearray

__all__ = [
    "ComputedPresence",
    "PresenceRow",
    "checked_presence_row",
    "first_absent",
    "hit_end_problem",
    "is_store_reachable_chunk",
    "last_present",
    "lookup_hit_tokens",
    "reachable_chunks",
]


# --------------------------------------------------------------------------- store side


def _check_non_negative_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {value}")
    return value


def is_store_reachable_chunk(
    chunk_index: int,
    storable_chunk_count: int,
    alignment_chunk_count: int | None,
    sliding_window_chunks: int | None,
    is_eagle: bool,
) -> bool:
    """Whether storing chunk ``chunk_index`` of a windowed group can ever serve a hit.

    Loads end on alignment boundaries (every ``alignment_chunk_count`` chunks of this
    group, the unbounded groups' chunk), and a windowed group only needs the last
    ``sliding_window_chunks`` chunks before a hit end (one more for an EAGLE group,
    whose lookup also checks the chunk after the hit and pops it). So inside each
    aligned segment only its tail can be read back. The last segment may be cut
    short by ``storable_chunk_count``: its tail is counted from where it really ends,
    because a hit on the same prompt ends there.

    ``alignment_chunk_count=None`` (unbounded groups, no alignment, or a window that
    covers a whole segment) makes every chunk reachable. Example: ``a=2, w=1,
    S=4`` -> chunks ``[1, 3]``.
    """
    _check_non_negative_int("chunk_index", chunk_index)
    _check_non_negative_int("storable_chunk_count", storable_chunk_count)
    if chunk_index >= storable_chunk_count:
        raise ValueError(
            f"chunk_index {chunk_index} out of range [0, {storable_chunk_count}) of the "
            "storable chunks"
        )
    if alignment_chunk_count is None:
        return True
    check_positive_int("alignment_chunk_count", alignment_chunk_count)
    if sliding_window_chunks is None:
        raise ValueError(
            f"alignment_chunk_count={alignment_chunk_count} needs sliding_window_chunks "
            "(only windowed groups have an alignment count)"
        )
    check_positive_int("sliding_window_chunks", sliding_window_chunks)
    position = chunk_index % alignment_chunk_count
    segment_length = min(alignment_chunk_count, storable_chunk_count - (chunk_index - position))
    return position >= segment_length - (sliding_window_chunks + int(is_eagle))


def reachable_chunks(
    storable_chunk_count: int,
    alignment_chunk_count: int | None,
    sliding_window_chunks: int | None,
    is_eagle: bool,
) -> list[int]:
    """All chunks ``i < storable_chunk_count`` for which :func:`is_store_reachable_chunk`
    holds, built segment by segment (same rule, no per-chunk modulo)."""
    _check_non_negative_int("storable_chunk_count", storable_chunk_count)
    if alignment_chunk_count is None:
        return list(range(storable_chunk_count))
    if sliding_window_chunks is None:
        raise ValueError(
            f"alignment_chunk_count={alignment_chunk_count} needs sliding_window_chunks"
        )
    tail = sliding_window_chunks + int(is_eagle)
    chunks: list[int] = []
    for segment_start in range(0, storable_chunk_count, alignment_chunk_count):
        segment_end = min(segment_start + alignment_chunk_count, storable_chunk_count)
        chunks.extend(range(max(segment_start, segment_end - tail), segment_end))
    return chunks


# --------------------------------------------------------------------------- presence scans

# Backward scans over a list slice the list in blocks that grow by this factor up
# to _MAX_BLOCK: the usual answer is a few chunks from the end (one small slice),
# while a long absent stretch is crossed in a handful of C-level `in` tests.
_FIRST_BLOCK = 16
_MAX_BLOCK = 4096


def first_absent(present: PresenceRow, lo: int, hi: int) -> int:
    """Smallest ``i`` in ``[lo, hi)`` whose chunk is absent, or ``hi`` if all are present.

    Returns ``lo`` when ``lo >= hi``. Lists/tuples compare elements with ``== False``
    and bytes-likes with ``== 0``: presence values must be bools (or 0/1).
    """
    if lo >= hi:
        return lo
    stop = min(hi, len(present))
    if lo >= stop:
        return lo  # chunks past the end of the sequence are absent
    if isinstance(present, (list, tuple)):
        try:
            return present.index(False, lo, stop)
        except ValueError:
            return stop
    if isinstance(present, (bytes, bytearray)):
        found = present.find(0, lo, stop)
        return stop if found < 0 else found
    for index in range(lo, stop):
        if not present[index]:
            return index
    return stop


def last_present(present: PresenceRow, lo: int, hi: int) -> int:
    """Largest ``i`` in ``[lo, hi)`` whose chunk is present, or ``lo - 1`` if none is."""
    stop = min(hi, len(present))
    if lo >= stop:
        return lo - 1
    if isinstance(present, (list, tuple)):
        end = stop
        size = _FIRST_BLOCK
        while end > lo:
            begin = max(lo, end - size)
            if True in present[begin:end]:
                for index in range(end - 1, begin - 1, -1):
                    if present[index]:
                        return index
            end = begin
            size = min(size * 4, _MAX_BLOCK)
        return lo - 1
    if isinstance(present, (bytes, bytearray)):
        found = present.rfind(1, lo, stop)
        return lo - 1 if found < 0 else found
    for index in range(stop - 1, lo - 1, -1):
        if present[index]:
            return index
    return lo - 1


# --------------------------------------------------------------------------- presence input

# Values a presence row may hold. The scans compare with ``== False`` (list.index),
# ``== True`` (``in``), ``== 0``/``== 1`` (bytes.find/rfind) or truthiness (the generic
# path); a value equal to neither, like ``2`` or ``"0"``, counted as present in one scan
# and absent in another, so a lookup gave another answer than for the same row as
# bools. Values equal to 0 or 1 (bools, 0/1 ints, numpy bools) behave alike everywhere.
_BINARY_VALUES = frozenset((0, 1))
# bytes.translate table: 0 and 1 -> 0, any other byte -> 1; ``find(1)`` on the result is
# the first bad index. Two C passes; measured 2.5 us for 8192 chunks, half of what
# deleting the good bytes (translate(None, b"\x00\x01")) costs.
_NON_BINARY = bytes([0, 0] + [1] * 254)


def checked_presence_row(group: int, row: object) -> PresenceRow:
    """``row`` checked as the presence of group ``group``, in the form the scans use.

    Raises TypeError unless ``row`` is a sequence of bools or 0/1, naming the group
    and, for a bad value, its index (``present[g][i]``). A list or tuple comes back
    as ``bytes`` (same answers, C-level ``find``/``rfind`` scans): converting costs
    one C pass, about what a single ``list.index`` scan of the row costs, and both
    checks the values and makes every later scan of the row fast. Bytes-likes are
    checked with one ``bytes.translate`` and ``find``; other sequences pay a Python loop.
    """
    if isinstance(row, ComputedPresence):
        return row  # bools by its contract, computed only where a scan reads
    if isinstance(row, (bytes, bytearray)):
        index = row.translate(_NON_BINARY).find(1)
        if index >= 0:
            raise TypeError(
                f"present[{group}][{index}] is {row[index]}: presence values must be 0 or 1"
            )
        return row
    if (
        row is None
        or isinstance(row, (str, Mapping))
        or not hasattr(row, "__len__")
        or not hasattr(row, "__getitem__")
    ):
        # A string is a sequence too, but of characters: "0000" is four truthy values.
        raise TypeError(
            f"present[{group}] must be a sequence of bools (one per chunk of group "
            f"{group} from chunk 0: a list, tuple, bytes or bytearray), got {row!r}"
        )
    dtype = getattr(row, "dtype", None)
    if getattr(dtype, "kind", None) == "b" and getattr(row, "ndim", None) == 1:
        # A 1-d numpy bool array: its raw bytes are the 0/1 presence (no per-value loop).
        return row.tobytes()  # type: ignore[attr-defined, no-any-return]
    if isinstance(row, (list, tuple)):
        try:
            packed = bytes(row)
        except (TypeError, ValueError):
            pass  # not all small ints (e.g. numpy bools, "0", -1): checked one by one below
        else:
            if packed.translate(_NON_BINARY).find(1) < 0:
                return packed
    if dtype is not None or isinstance(row, (list, tuple)):
        # Arrays and lists of other element types (numpy ints, "0", -1): checked now.
        for index in range(len(row)):  # type: ignore[arg-type]
            _checked_value(group, index, row[index])  # type: ignore[index]
        return row  # type: ignore[return-value]
    # Any other sequence may compute its values on access (vLLM's manager is asked per
    # chunk): each value is checked when a scan reads it, so a lookup still reads only
    # the chunks it needs.
    return _CheckedRow(group, row)  # type: ignore[arg-type]


def _checked_value(group: int, index: int, value: object) -> bool:
    try:
        ok = value in _BINARY_VALUES
    except TypeError:  # unhashable
        ok = False
    if not ok:
        raise TypeError(
            f"present[{group}][{index}] is {value!r}: presence values must be bools (or 0/1)"
        )
    return bool(value)


class ComputedPresence(Sequence[bool]):
    """A presence row whose values are computed when a scan reads them.

    Subclasses give ``len()`` and :meth:`chunk_present` (a bool for chunk ``index`` in
    ``[0, len)``); indexing, negative indices and slices are handled here. The lookup
    takes such rows as they are, without reading them whole: a scan asks only for the
    chunks it needs.
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def chunk_present(self, index: int) -> bool:
        """Whether chunk ``index`` (``0 <= index < len(self)``) is present."""

    @overload
    def __getitem__(self, index: int) -> bool: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bool]: ...
    def __getitem__(self, index: int | slice) -> bool | Sequence[bool]:
        if isinstance(index, slice):
            return [self.chunk_present(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"chunk {index} out of range [0, {len(self)})")
        return self.chunk_present(index)


class _CheckedRow(ComputedPresence):
    """A presence row whose values are checked as they are read (see checked_presence_row)."""

    def __init__(self, group: int, row: Sequence[object]) -> None:
        self._group = group
        self._row = row

    def __len__(self) -> int:
        return len(self._row)

    def chunk_present(self, index: int) -> bool:
        return _checked_value(self._group, index, self._row[index])


# --------------------------------------------------------------------------- load side


def _group_hit_end(
    group: GroupPlan,
    present: PresenceRow,
    num_tokens: int,
    num_computed_tokens: int,
    max_hit: int,
) -> int:
    """The largest hit end (tokens) ``<= max_hit`` this group alone can serve, or -1.

    A hit end ``H > num_computed_tokens`` is servable when every chunk
    :meth:`GroupPlan.needed_chunks` names for ``H`` (plus the chunk after them for an
    EAGLE group, which queries one chunk more and pops it) is present or on the GPU
    already (below ``num_computed_tokens // tokens_per_chunk``), and only the request's
    full chunks (``num_tokens // tokens_per_chunk``) are ever present. -1: no such
    ``H``; the whole lookup then loads nothing.

    - Unbounded groups: servable ends form one interval above the computed tokens, up
      to the end of the present prefix, so the answer is ``min(max_hit, prefix end)``.
      It may lie inside one of this group's chunks: a load takes that chunk whole.
    - Windowed groups (sliding window, chunked local, Mamba): inside one chunk a later
      end never needs an earlier chunk than a sooner end (the first needed token only
      moves forward), so the best end in each chunk is ``max_hit`` itself (when it is
      off this group's grid) or the chunk's last token. The candidates are therefore
      ``max_hit`` and then the chunk boundaries below it, walked downwards: a candidate
      failing at absent chunk ``q`` rules out every boundary above ``q``, so the walk
      jumps there (and, for groups that always need the chunk just before the end,
      past the absent stretch below it) with C-level scans.
    - Mamba: the state of chunk ``i`` is the one after its last token, so a hit must end
      exactly on this group's chunk boundary (vLLM before PR #44599 restored a
      state between two stored ones); ``max_hit`` off the grid is never a candidate.
    """
    tpc = group.tokens_per_chunk
    full_chunks = num_tokens // tpc
    extra = int(group.is_eagle)
    max_hit = min(max_hit, full_chunks * tpc)
    if max_hit <= num_computed_tokens:
        return -1
    start = num_computed_tokens // tpc
    window = group.sliding_window_size_in_chunks
    if window is None:
        top = -(-max_hit // tpc)  # chunk index just past the last chunk the hit touches
        end = first_absent(present, start, min(top + extra, full_chunks)) - extra
        hit = min(max_hit, end * tpc)
        return hit if hit > num_computed_tokens else -1
    spec = group.spec
    kind = spec.kind
    if max_hit % tpc and kind is not GroupKind.MAMBA:
        lo, top = group.needed_chunks(max_hit)
        stop = top + extra
        if stop <= full_chunks and first_absent(present, max(start, lo), stop) == stop:
            return max_hit
    # Chunk-boundary candidates ``H = end * tpc``; an EAGLE group also needs chunk ``end``.
    end = min(max_hit // tpc, full_chunks - extra)
    # Groups whose every boundary end needs the chunk just before it (Mamba; a sliding
    # window reaching at least one token back) may skip absent stretches at once.
    reach_back = 0  # tokens before H the group reads; -1: depends on H (chunked local)
    if kind is GroupKind.SLIDING_WINDOW:
        assert spec.sliding_window is not None
        reach_back = spec.sliding_window - 1
    elif kind is GroupKind.CHUNKED_LOCAL:
        reach_back = -1
    skip_absent = kind is GroupKind.MAMBA or reach_back > 0
    chunk = spec.attention_chunk_size or 0
    while end * tpc > num_computed_tokens:
        if skip_absent:
            last = last_present(present, start, end)
            if last < start:
                return -1
            end = last + 1
        hit = end * tpc
        if kind is GroupKind.MAMBA:
            lo = end - 1
        elif reach_back >= 0:
            lo = (hit - reach_back) // tpc
        else:
            lo = (hit - hit % chunk) // tpc
        stop = end + extra
        gap = first_absent(present, max(start, lo), stop)
        if gap == stop:
            return hit
        end = gap - extra
    return -1


def _hit_bound(plan: OffloadPlan, num_tokens: int, max_hit_end: int | None) -> int:
    """The largest hit end any lookup may return, before the groups cut it."""
    bound = num_tokens
    if plan.windowed_group_order:
        bound -= 1  # the last prompt token is recomputed for its logits
    if max_hit_end is not None:
        _check_non_negative_int("max_hit_end", max_hit_end)
        bound = min(bound, max_hit_end)
    if plan.mamba_align_tokens is not None:
        bound -= bound % plan.mamba_align_tokens
    return bound


def hit_end_problem(
    plan: OffloadPlan,
    num_tokens: int,
    num_computed_tokens: int,
    present: Sequence[PresenceRow],
    hit_end: int,
) -> str | None:
    """Why a load ending at ``hit_end`` would not restore a cold prefill's state there,
    or None when it would (the same rules :func:`lookup_hit_tokens` maximises).

    Used to judge another lookup's answer (an engine's own rule) on the same pool: the
    message names the bound or the first group that cannot serve the end.
    """
    _check_non_negative_int("hit_end", hit_end)
    if hit_end <= num_computed_tokens:
        return f"hit end {hit_end} does not pass the {num_computed_tokens} computed tokens"
    bound = num_tokens - 1 if plan.windowed_group_order else num_tokens
    if hit_end > bound:
        recompute = " (the last one is recomputed for its logits)" if bound < num_tokens else ""
        return f"hit end {hit_end} exceeds {bound} of {num_tokens} prompt tokens{recompute}"
    for index, group in enumerate(plan.groups):
        served = _group_hit_end(group, present[index], num_tokens, num_computed_tokens, hit_end)
        if served == hit_end:
            continue
        spec = group.spec
        if spec.kind is GroupKind.MAMBA and hit_end % group.tokens_per_chunk:
            why = f"off its {group.tokens_per_chunk}-token chunk grid (no state stored there)"
        else:
            lo, top = group.needed_chunks(hit_end)
            why = f"a chunk it reads in [{lo}, {top + int(group.is_eagle)}) is absent"
        return f"group {index} ({spec.label!r}, {spec.kind.value}): hit end {hit_end} is {why}"
    return None


def lookup_hit_tokens(
    plan: OffloadPlan,
    num_tokens: int,
    num_computed_tokens: int,
    present: Sequence[PresenceRow],
    *,
    max_hit_end: int | None = None,
) -> int:
    """Tokens beyond ``num_computed_tokens`` that may be loaded (see ``OffloadPlan.lookup``).

    1. ``max_hit = num_tokens``; with any windowed group the last token is kept for
       recompute (its logits); ``max_hit_end`` (a load budget: the engine's cap on the
       hit end) lowers it further; with ``mamba_align_tokens`` the result is rounded
       down to it (the fix of vLLM PR #44599). Each Mamba group rounds down to its own
       grid again when visited (``_group_hit_end``), which also covers a hit cut by a
       later group; rounding here first keeps the unbounded groups' scans short.
    2. Unbounded groups first: a shorter hit never invalidates a prefix, so they are
       visited once. Then windowed groups, widest window first.
    3. A windowed group checked at a larger hit than the final one may not hold its
       window before the smaller hit, so the windowed groups are visited again
       until a pass leaves the hit unchanged after its first group (a group's check
       is idempotent at its own result, so the first group of a pass can't be stale).
       Each repeat strictly lowers the hit, so the loop ends.
    A group that can serve no end beyond ``num_computed_tokens`` ends the lookup with
    0. A hit shorter than some group's chunk is kept when it is valid (that group's
    load takes the chunk holding the hit whole): the result is the largest valid hit,
    never less than another rule's valid hit on the same pool.

    Each group's check maps a bound ``M`` to the largest hit end ``<= M`` it can
    serve; that map is monotone, never raises ``M`` and is idempotent, so the loop
    reaches the largest hit end every group accepts. The visit order therefore only
    decides how fast it gets there (unbounded groups and wide windows cut the most
    first), never the result: permuting the groups gives the same answer.
    """
    # Checked by what the lookup reads, not by class: plan imports this module, and an
    # import back would make the two one module.
    if not all(hasattr(plan, field) for field in _PLAN_FIELDS):
        raise TypeError(f"plan must be an OffloadPlan, got {plan!r}")
    for field, value in (("num_tokens", num_tokens), ("num_computed_tokens", num_computed_tokens)):
        _check_non_negative_int(field, value)
    if num_computed_tokens > num_tokens:
        raise ValueError(
            f"num_computed_tokens {num_computed_tokens} exceeds num_tokens {num_tokens}"
        )
    groups = plan.groups
    if present is None or isinstance(present, (str, bytes, bytearray, Mapping)):
        raise TypeError(f"present must be a sequence of presence rows, got {present!r}")
    if len(present) != len(groups):
        raise ValueError(
            f"present has {len(present)} entries, expected one per group ({len(groups)})"
        )
    present = [checked_presence_row(index, row) for index, row in enumerate(present)]
    max_hit = _hit_bound(plan, num_tokens, max_hit_end)
    windowed = plan.windowed_group_order
    for index in plan.unbounded_group_order:
        max_hit = _group_hit_end(
            groups[index], present[index], num_tokens, num_computed_tokens, max_hit
        )
        if max_hit < 0:
            return 0
    while True:
        stable = True
        for position, index in enumerate(windowed):
            new_hit = _group_hit_end(
                groups[index], present[index], num_tokens, num_computed_tokens, max_hit
            )
            if new_hit < 0:
                return 0
            if new_hit < max_hit and position > 0:
                stable = False
            max_hit = new_hit
        if stable:
            break
    return max_hit - num_computed_tokens
