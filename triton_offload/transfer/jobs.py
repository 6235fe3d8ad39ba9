"""Jobs: what to copy (``JobSpec``) and its validated pair table.

A job names, per cache group ``g``, GPU block ids ``B_g``, host rows (chunk ids)
``H_g`` and the logical index ``s_g`` of ``B_g[0]`` in its request. The k-th GPU block
sits at position ``p = (s_g mod bpc) + k``: host row ``H_g[p // bpc]``, slot
``p mod bpc`` (``bpc`` = blocks per chunk). Host bytes outside the addressed slots stay
untouched.

:func:`pair_table` turns a spec into the int64 ``(gpu_block, pool_row, slot)`` pair
table every copier reads (one row per block pair, whatever the number of layers) and
checks it completely, vectorized, before any byte moves: ids in range, enough host
rows, and no two pairs of a job writing the same destination bytes (also across groups
that alias cache memory or share pool-row bytes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from triton_offload.transfer.layout import CacheLayout, pages_meet

_INT64_MAX = (1 << 63) - 1
_BOOL_TYPES = frozenset((bool, np.bool_))
_INT_ONLY = frozenset((int,))


class Direction(enum.IntEnum):
    """Which way a job copies. A device-resident pool makes it a device -> device copy."""

    TO_POOL = 0  # store: cache planes -> pool rows
    FROM_POOL = 1  # load: pool rows -> cache planes


TO_POOL = Direction.TO_POOL
FROM_POOL = Direction.FROM_POOL
DIRECTION_NAMES = {TO_POOL: "store", FROM_POOL: "load"}


def _first_int_beyond_int64(values: Any) -> int | None:
    """The first Python int of ``values`` outside int64 (numpy turns such a list into
    floats or objects, whose dtype alone would misname the problem)."""
    if isinstance(values, (list, tuple)):
        for value in values:
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                return value
    return None


def _non_integer(values: Any, array: np.ndarray) -> str:
    """The first id of a non-integer ``array`` (made from ``values``), as ``"<type>
    <value> at index <i>"``. A float array names its first NaN, infinity or fraction
    (a cast to int64 would turn NaN into -2**63 and 1.5 into 1); otherwise a list or an
    object array names its first element that is not an int (numpy turns [5, "a"] into
    strings and [5, 7.0] into floats); otherwise the first id."""
    index = None
    if array.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(array) | (array != np.trunc(array)))
        if bad.size:
            index = int(bad[0])
    if index is None and (isinstance(values, (list, tuple)) or array.dtype.kind == "O"):
        integers = (int, np.integer)
        index = next((i for i, v in enumerate(values) if not isinstance(v, integers)), None)
    index = 0 if index is None else index
    value = array[index]
    value = value.item() if isinstance(value, np.generic) else value
    if array.dtype.kind in "US" or (array.dtype.kind == "O" and not isinstance(value, int)):
        kind = type(value).__name__  # the dtype says less than the value's own type
    else:
        kind = str(array.dtype)
    text = "NaN" if isinstance(value, float) and value != value else repr(value)
    return f"{kind} {text} at index {index}"


def int64_ids(values: Any, what: str) -> tuple[np.ndarray, bool]:
    """``values`` as a 1-d int64 array, and whether that array is new (not ``values``).

    Any integer dtype or Python ints are taken; bools, floats (NaN included), strings,
    objects and arrays of another rank are refused, TypeError/ValueError naming ``what``,
    the value and its index. Signs are not checked here.
    """
    if isinstance(values, (str, bytes)) or values is None:
        raise TypeError(f"{what} must be a sequence of integer ids, got {values!r}")
    if isinstance(values, torch.Tensor):
        if values.is_meta:
            raise ValueError(f"{what} is a tensor on the meta device (no data): ids must be real")
        values = values.detach().cpu().numpy()
    elif isinstance(values, (list, tuple)) and not _BOOL_TYPES.isdisjoint(map(type, values)):
        # np.asarray([True, 7]) is the int array [1, 7]: True would name block 1.
        index = next(i for i, v in enumerate(values) if type(v) in _BOOL_TYPES)
        raise TypeError(
            f"{what} must hold integer ids, got bool {values[index]!r} at index {index}"
        )
    fresh = not isinstance(values, np.ndarray)  # a list becomes a new array: no copy needed
    array = np.asarray(values)
    if array.ndim != 1:
        # Checked before emptiness: a [0, n] array is no list of ids either.
        raise ValueError(f"{what} must be a 1-d sequence of ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64), True
    if array.dtype != np.int64:
        if array.dtype.kind not in "iu":
            too_big = _first_int_beyond_int64(values)
            if too_big is not None:
                raise ValueError(f"{what} id {too_big} does not fit in a 64-bit signed id")
            raise TypeError(f"{what} must hold integer ids, got {_non_integer(values, array)}")
        if array.dtype.kind == "u" and int(array.max()) > _INT64_MAX:
            raise ValueError(f"{what}: id {int(array.max())} out of range")
        return array.astype(np.int64), True
    return array, fresh


def _ids(values: Any, side: str, kind: str, group: int) -> np.ndarray:
    """A read-only 1-d int64 array of non-negative ids; ValueError/TypeError naming
    ``side[group]`` (the message is built only for a value the fast path does not take)."""
    if type(values) is list and values and _INT_ONLY.issuperset(map(type, values)):
        # The common caller's form, a list of Python ints, in three calls (a small job's
        # spec cost two thirds less: bench/suites/bench_small_jobs.py). Anything else,
        # an id beyond int64 included, takes the general path and its messages.
        lowest = min(values)
        if lowest >= 0:
            try:
                array = np.array(values, dtype=np.int64)
            except OverflowError:
                pass
            else:
                array.setflags(write=False)
                return array
    what = f"{side}[{group}]"
    array, fresh = int64_ids(values, what)
    if not fresh:
        array = array.copy()  # a private copy: the spec is immutable
    if array.size and array.min() < 0:
        bad = int(array[np.argmax(array < 0)])
        raise ValueError(f"{kind} id {bad} of group {group} is negative ({what})")
    array.setflags(write=False)
    return array


def _plain_ids(groups: list[Any]) -> tuple[np.ndarray, ...] | None:
    """Per group, the read-only int64 array of a list of non-negative Python ints (what
    :func:`_ids` makes of it); None unless every group is such a list that fits int64
    (the general path then gives the messages)."""
    arrays = []
    for values in groups:
        if type(values) is not list or not _INT_ONLY.issuperset(map(type, values)):
            return None
        if values and min(values) < 0:
            return None
        try:
            array = np.array(values, dtype=np.int64)
        except OverflowError:
            return None
        array.setflags(write=False)
        arrays.append(array)
    return tuple(arrays)


def _per_group(values: Any, what: str) -> Sequence[Any]:
    if type(values) is list or type(values) is tuple:
        return values
    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(
        values, (Sequence, np.ndarray)
    ):
        raise TypeError(f"{what} must be a sequence with one entry per group, got {values!r:.80}")
    return values


@dataclass(frozen=True, eq=False)
class JobSpec:
    """One job: per group, GPU block ids, host rows and the first block's logical index.

    ``gpu_blocks[g]`` / ``host_blocks[g]`` are read-only int64 arrays (any integer
    sequence, numpy array or tensor is accepted and copied); ``first_block_index[g]``
    (default 0) places ``gpu_blocks[g][0]`` at slot ``first_block_index[g] % bpc`` of
    ``host_blocks[g][0]``. Construction checks what needs no cache geometry: one entry
    per group in each list, integer non-negative ids and indices (TypeError/ValueError
    naming the group and value). Ranges and the number of host rows are checked against
    the engine's layout by :func:`pair_table`.
    """

    gpu_blocks: tuple[np.ndarray, ...]
    host_blocks: tuple[np.ndarray, ...]
    first_block_index: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        gpu = _per_group(self.gpu_blocks, "gpu_blocks")
        host = _per_group(self.host_blocks, "host_blocks")
        if len(gpu) != len(host):
            raise ValueError(f"gpu_blocks has {len(gpu)} groups but host_blocks has {len(host)}")
        indices: list[int] | tuple[int, ...]
        if self.first_block_index is None:
            indices = (0,) * len(gpu)
        else:
            first = _per_group(self.first_block_index, "first_block_index")
            if len(first) != len(gpu):
                raise ValueError(
                    f"first_block_index has {len(first)} groups but gpu_blocks has {len(gpu)}"
                )
            indices = []
            for group, value in enumerate(first):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"first_block_index[{group}] {value!r} is not an int")
                if value < 0:
                    raise ValueError(f"first_block_index[{group}] {value} is negative")
                indices.append(int(value))
        gpu_ids = tuple([_ids(v, "gpu_blocks", "GPU block", g) for g, v in enumerate(gpu)])
        host_ids = tuple([_ids(v, "host_blocks", "host block", g) for g, v in enumerate(host)])
        object.__setattr__(self, "gpu_blocks", gpu_ids)
        object.__setattr__(self, "host_blocks", host_ids)
        object.__setattr__(self, "first_block_index", tuple(indices))

    @property
    def num_groups(self) -> int:
        return len(self.gpu_blocks)

    @property
    def num_pairs(self) -> int:
        """GPU blocks of the job over all groups (one pair-table row each)."""
        return sum(blocks.size for blocks in self.gpu_blocks)

    @classmethod
    def from_groups(cls, groups: Iterable[tuple[Any, Any, int]]) -> JobSpec:
        """A spec from one ``(gpu_blocks, host_blocks, first_block_index)`` per group."""
        parts = list(groups)
        return cls(
            [part[0] for part in parts], [part[1] for part in parts], [part[2] for part in parts]
        )

    @classmethod
    def of(
        cls,
        spec: JobSpec | None,
        *,
        gpu_blocks: Any = None,
        host_blocks: Any = None,
        first_block_index: Any = None,
    ) -> JobSpec:
        """``spec`` itself, or a spec from the keyword lists (exactly one of the two).

        The entry point of ``submit_store``/``submit_load``: a positional list where a
        spec belongs is refused, so the two block lists cannot be swapped by position.
        """
        lists = (gpu_blocks, host_blocks, first_block_index)
        if spec is not None:
            if not isinstance(spec, JobSpec):
                raise TypeError(
                    f"the job must be a JobSpec or given as gpu_blocks=/host_blocks= "
                    f"keywords, got {type(spec).__name__} {spec!r:.60}"
                )
            if any(value is not None for value in lists):
                raise TypeError("give either a JobSpec or gpu_blocks=/host_blocks=, not both")
            return spec
        if gpu_blocks is None or host_blocks is None:
            raise TypeError("a job needs gpu_blocks= and host_blocks= (or a JobSpec)")
        if (
            first_block_index is None
            and type(gpu_blocks) is list
            and type(host_blocks) is list
            and len(gpu_blocks) == len(host_blocks)
        ):
            # Lists of lists of non-negative Python ints, the common caller's form: the
            # spec __post_init__ would make, without its per-value dispatch.
            gpu_ids, host_ids = _plain_ids(gpu_blocks), _plain_ids(host_blocks)
            if gpu_ids is not None and host_ids is not None:
                made = object.__new__(cls)
                # A frozen dataclass's fields live in the instance dict.
                made.__dict__.update(
                    gpu_blocks=gpu_ids, host_blocks=host_ids, first_block_index=(0,) * len(gpu_ids)
                )
                return made
        return cls(gpu_blocks, host_blocks, first_block_index)


class PlainJob(NamedTuple):
    """A small job given as keyword lists of lists of non-negative Python ints (what
    ``JobSpec(gpu_blocks, host_blocks)`` accepts with every first index 0), kept as
    copies of the lists: :func:`plain_pair_table` builds its table without the spec's
    arrays (made, checked and converted back to lists, they were a third of a 2-page
    job's fixed cost: ``bench/suites/bench_small_jobs.py``)."""

    gpu_blocks: list[list[int]]
    host_blocks: list[list[int]]


def plain_job(gpu_blocks: Any, host_blocks: Any) -> PlainJob | None:
    """The job as a :class:`PlainJob`, or None unless both are lists (one entry per
    group) of lists of non-negative Python ints within int64, with at most
    ``SMALL_JOB_PAIRS`` GPU blocks in all: anything else takes ``JobSpec`` and its
    messages."""
    if type(gpu_blocks) is not list or type(host_blocks) is not list:
        return None
    if len(gpu_blocks) != len(host_blocks):
        return None
    gpu, host, pairs = [], [], 0
    for side, copies in ((gpu_blocks, gpu), (host_blocks, host)):
        for values in side:
            if type(values) is not list or not _INT_ONLY.issuperset(map(type, values)):
                return None
            if values and (min(values) < 0 or max(values) > _INT64_MAX):
                return None
            copies.append(values.copy())
    for values in gpu:
        pairs += len(values)
    return PlainJob(gpu, host) if pairs <= SMALL_JOB_PAIRS else None


def plain_pair_table(
    layout: CacheLayout, pool_rows: int, job: PlainJob, direction: Direction
) -> PairTable:
    """:func:`pair_table` of ``JobSpec(*job)``: the same table, checks and messages."""
    if len(job.gpu_blocks) != layout.num_groups:
        raise ValueError(
            f"the job has {len(job.gpu_blocks)} groups but the engine has {layout.num_groups}"
        )
    if type(direction) is not Direction:
        try:
            direction = Direction(direction)
        except ValueError:
            raise ValueError(f"direction {direction!r} is not a Direction") from None
    firsts = (0,) * len(job.gpu_blocks)
    return _table_of_lists(layout, pool_rows, job.gpu_blocks, job.host_blocks, firsts, direction)


class PairTable(NamedTuple):
    """A validated job: int64 ``pairs [n, 3]`` (gpu_block, pool_row, slot) ordered by
    group, and ``offsets [num_groups + 1]`` (pairs of group g: ``offsets[g]:offsets[g+1]``)."""

    pairs: np.ndarray
    offsets: np.ndarray


#: Jobs of at most this many block pairs are built and checked with Python ints: below
#: it numpy's fixed cost per call (~1 us, some 40 calls per job) outweighs the per-pair
#: work. ``bench/suites/bench_small_jobs.py`` measures the job path against a per-page loop.
SMALL_JOB_PAIRS = 64


def pair_table(
    layout: CacheLayout, pool_rows: int, spec: JobSpec, direction: Direction | int
) -> PairTable:
    """The job's pair table, fully validated; ValueError naming the bad value, nothing copied.

    Checks the ids against the layout (GPU blocks per group, ``pool_rows`` host rows),
    that the host rows cover the blocks, and that no two pairs write the same
    destination page (also across groups aliasing cache memory or sharing pool-row
    bytes).
    """
    if not isinstance(spec, JobSpec):
        raise TypeError(f"spec must be a JobSpec, got {type(spec).__name__}")
    if spec.num_groups != layout.num_groups:
        raise ValueError(
            f"the job has {spec.num_groups} groups but the engine has {layout.num_groups}"
        )
    if type(direction) is not Direction:
        try:
            direction = Direction(direction)
        except ValueError:
            raise ValueError(f"direction {direction!r} is not a Direction") from None
    if sum([blocks.size for blocks in spec.gpu_blocks]) <= SMALL_JOB_PAIRS:
        return _small_pair_table(layout, pool_rows, spec, direction)
    bpc = layout.blocks_per_chunk
    assert spec.first_block_index is not None
    counts = np.array([blocks.size for blocks in spec.gpu_blocks], dtype=np.int64)
    offsets = np.zeros(layout.num_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    pairs = np.empty((int(offsets[-1]), 3), dtype=np.int64)
    for group, (blocks, hosts, first) in enumerate(
        zip(spec.gpu_blocks, spec.host_blocks, spec.first_block_index, strict=True)
    ):
        limit = layout.group_num_blocks[group]
        if blocks.size and int(blocks.max()) >= limit:
            bad = int(blocks[np.argmax(blocks >= limit)])
            raise ValueError(_block_out_of_range(bad, group, limit))
        if hosts.size and int(hosts.max()) >= pool_rows:
            bad = int(hosts[np.argmax(hosts >= pool_rows)])
            raise ValueError(_host_out_of_range(bad, group, pool_rows))
        if not blocks.size:
            continue
        positions = (first % bpc) + np.arange(blocks.size, dtype=np.int64)
        if positions[-1] // bpc >= hosts.size:
            raise ValueError(_too_few_hosts(group, blocks.size, first % bpc, bpc, hosts.size))
        rows = pairs[offsets[group] : offsets[group + 1]]
        rows[:, 0] = blocks
        rows[:, 1] = hosts[positions // bpc]
        rows[:, 2] = positions % bpc
    # Ranges hold by construction; what is left is two pairs writing one page.
    if pairs.shape[0]:
        groups = np.repeat(np.arange(layout.num_groups, dtype=np.int64), counts)
        _check_destinations(layout, pool_rows, pairs, groups, offsets, direction)
    return PairTable(pairs, offsets)


def _block_out_of_range(bad: int, group: int, limit: int) -> str:
    return f"GPU block id {bad} of group {group} out of range [0, {limit})"


def _host_out_of_range(bad: int, group: int, limit: int) -> str:
    return f"host block id {bad} of group {group} out of range [0, {limit})"


def _too_few_hosts(group: int, count: int, slot: int, bpc: int, hosts: int) -> str:
    needed = (slot + count - 1) // bpc + 1
    return (
        f"group {group}: {count} GPU blocks starting at slot {slot} need {needed} host "
        f"chunks of {bpc} blocks, but {hosts} host blocks were given"
    )


def _small_pair_table(
    layout: CacheLayout, pool_rows: int, spec: JobSpec, direction: Direction
) -> PairTable:
    """:func:`pair_table` with Python ints: the same table, checks and messages."""
    return _table_of_lists(
        layout,
        pool_rows,
        [blocks.tolist() for blocks in spec.gpu_blocks],
        [hosts.tolist() for hosts in spec.host_blocks],
        spec.first_block_index or (),
        direction,
    )


def _table_of_lists(
    layout: CacheLayout,
    pool_rows: int,
    gpu_blocks: Sequence[list[int]],
    host_blocks: Sequence[list[int]],
    firsts: Sequence[int],
    direction: Direction,
) -> PairTable:
    """A small job's table from per-group lists of non-negative ids (one entry per group
    of the layout), checked as :func:`pair_table` checks it.

    Each pair's destination gets one int key (store: group, pool row and slot; load:
    group and GPU block), so a job without a clash costs one set; the pairs are walked
    in order only to name the first clash.
    """
    bpc = layout.blocks_per_chunk
    store = direction == Direction.TO_POOL
    flat: list[int] = []  # the table, row-major
    keys: list[int] = []
    offsets = [0]
    for group, first in enumerate(firsts):
        blocks, hosts = gpu_blocks[group], host_blocks[group]
        limit = layout.group_num_blocks[group]
        if blocks and max(blocks) >= limit:
            raise ValueError(
                _block_out_of_range(next(b for b in blocks if b >= limit), group, limit)
            )
        if hosts and max(hosts) >= pool_rows:
            bad = next(h for h in hosts if h >= pool_rows)
            raise ValueError(_host_out_of_range(bad, group, pool_rows))
        slot = first % bpc
        if blocks and (slot + len(blocks) - 1) // bpc >= len(hosts):
            raise ValueError(_too_few_hosts(group, len(blocks), slot, bpc, len(hosts)))
        # Keys of different groups differ: ids are below pool_rows (store) or limit (load).
        key_base = group * pool_rows * bpc if store else group * (1 << 63)
        for position, block in enumerate(blocks, slot):
            row, row_slot = hosts[position // bpc], position % bpc
            flat += (block, row, row_slot)
            keys.append(key_base + row * bpc + row_slot if store else key_base + block)
        offsets.append(len(keys))
    if len(set(keys)) != len(keys) or (store and layout.pool_shared_groups):
        _small_clashes(layout, flat, offsets, store)
    pairs = np.array(flat, dtype=np.int64)
    pairs.shape = (len(keys), 3)  # in place: no view to make
    offset_array = np.array(offsets, dtype=np.int64)
    if not store and layout.alias_rules:
        # Groups aliasing cache memory meet by byte range, not by equal block ids.
        _check_cache_aliasing(layout, pairs, offset_array)
    return PairTable(pairs, offset_array)


def _small_clashes(layout: CacheLayout, flat: list[int], offsets: list[int], store: bool) -> None:
    """ValueError naming the first clash of a small job's pairs (``flat``: the table
    row-major), in :func:`pair_table`'s order and words: two pairs of one group writing
    one destination, then (stores) a pool row written by groups sharing its bytes."""
    rows = [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
    groups = [g for g in range(len(offsets) - 1) for _ in range(offsets[g + 1] - offsets[g])]
    if store:
        seen: dict[tuple[int, int, int], int] = {}
        for j, (row, group) in enumerate(zip(rows, groups, strict=True)):
            i = seen.setdefault((group, row[1], row[2]), j)
            if i != j:
                raise ValueError(_pool_clash(i, j, row[1], row[2], group))
    else:
        seen_blocks: dict[tuple[int, int], int] = {}
        for j, (row, group) in enumerate(zip(rows, groups, strict=True)):
            i = seen_blocks.setdefault((group, row[0]), j)
            if i != j:
                raise ValueError(_cache_clash(i, j, row[0], group))
        return
    shared, column, what = layout.pool_shared_groups, 1, "pool row"
    if shared:
        writers: dict[int, set[int]] = {}
        for row, group in zip(rows, groups, strict=True):
            writers.setdefault(row[column], set()).add(group)
        for ident in sorted(writers):
            for g, h in shared:  # sorted pairs: the message names the lowest clash
                if g in writers[ident] and h in writers[ident]:
                    raise ValueError(_shared_clash(what, ident, g, h))


def _pool_clash(i: int, j: int, row: int, slot: int, group: int) -> str:
    return f"pairs {i} and {j} both write pool row {row} slot {slot} (group {group})"


def _cache_clash(i: int, j: int, block: int, group: int) -> str:
    return f"pairs {i} and {j} both write GPU block id {block} (group {group})"


def _shared_clash(what: str, ident: int, g: int, h: int) -> str:
    return f"{what} {ident} is written by groups {g} and {h}, whose planes share those bytes"


def _host_int64(name: str, table: Any) -> np.ndarray:
    if isinstance(table, torch.Tensor):
        if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {table.dtype}")
        return table.detach().cpu().numpy().astype(np.int64, copy=False)
    array = np.asarray(table)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def _first_duplicate(
    major: np.ndarray, minor: np.ndarray, minor_limit: int
) -> tuple[int, int] | None:
    """Indices (earlier, later) of the first pair whose (major, minor) key repeats, or None.

    Keys are packed into one int64 (``minor`` is in ``[0, minor_limit)``) so that the
    common case, no repeat, costs one sort.
    """
    if int(major.max()) >= _INT64_MAX // max(minor_limit, 1):
        raise ValueError(f"ids too large to check for repeats: {int(major.max())}")
    keys = major * minor_limit + minor
    if not np.any(np.diff(np.sort(keys)) == 0):
        return None
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    seconds = order[repeated + 1]
    k = int(np.argmin(seconds))
    return int(order[repeated[k]]), int(seconds[k])


def _check_cache_aliasing(layout: CacheLayout, table: np.ndarray, offsets: np.ndarray) -> None:
    """ValueError if two groups of a load write the same cache bytes, by byte range.

    Hybrid allocators let groups alias one tensor, also with another block size or a
    shifted view (``x`` and ``x[1:]``): equal block ids are neither needed nor enough for
    a clash. Each plane pair that shares bytes (``layout.alias_rules``) is checked on the
    job's blocks only: with equal block strides by the block offsets that meet (a set
    lookup), otherwise by sorting one side's pages (``pages_meet``).
    """
    for rule in layout.alias_rules:
        lo_a, hi_a = int(offsets[rule.group_a]), int(offsets[rule.group_a + 1])
        lo_b, hi_b = int(offsets[rule.group_b]), int(offsets[rule.group_b + 1])
        if lo_a == hi_a or lo_b == hi_b:
            continue
        a_blocks, b_blocks = table[lo_a:hi_a, 0], table[lo_b:hi_b, 0]
        plane_a, plane_b = layout.planes[rule.plane_a], layout.planes[rule.plane_b]
        found = -1
        if rule.offsets is not None:
            # Sorted b and one searchsorted per offset: a few us where np.isin costs tens.
            b_sorted = np.sort(b_blocks)
            for shift in range(rule.offsets[0], rule.offsets[1] + 1):
                wanted = a_blocks + shift
                at = np.minimum(np.searchsorted(b_sorted, wanted), b_sorted.size - 1)
                hit = b_sorted[at] == wanted
                if hit.any():
                    found = int(np.argmax(hit))
                    other = int(a_blocks[found]) + shift
                    break
        else:
            found = pages_meet(plane_a, a_blocks, plane_b, b_blocks)
            if found >= 0:
                start = plane_a.base_address + int(a_blocks[found]) * plane_a.block_stride
                end = start + plane_a.page_bytes
                b_starts = plane_b.base_address + b_blocks * plane_b.block_stride
                meets = (b_starts < end) & (b_starts + plane_b.page_bytes > start)
                other = int(b_blocks[np.argmax(meets)])
        if found < 0:
            continue
        block = int(a_blocks[found])
        where = f"({plane_a.name} and {plane_b.name})"
        if block == other:
            raise ValueError(
                f"GPU block id {block} is written by groups {rule.group_a} and "
                f"{rule.group_b}, whose planes share those bytes {where}"
            )
        raise ValueError(
            f"GPU block id {block} of group {rule.group_a} and GPU block id {other} of group "
            f"{rule.group_b} write the same bytes {where}"
        )


def validate_pairs(
    layout: CacheLayout,
    pool_rows: int,
    pairs: Any,
    group_offsets: Any,
    direction: Direction | int,
) -> None:
    """Check a job's pair table on the host (vectorized); ValueError naming the bad value.

    ``pairs``: ``[n, 3]`` (gpu_block_id, pool_row, slot), ``group_offsets``:
    ``[num_groups + 1]``; CPU tensors or numpy arrays (device tensors are copied, which
    synchronises). Rejects negative or out-of-range ids, rows (``pool_rows``) and slots,
    inconsistent group offsets, and two pairs of the job writing the same destination page.
    """
    try:
        direction = Direction(direction)
    except ValueError:
        raise ValueError(f"direction {direction!r} is not a Direction") from None
    table = _host_int64("pairs", pairs)
    offsets = _host_int64("group_offsets", group_offsets)
    if table.ndim != 2 or table.shape[1] != 3:
        raise ValueError(f"pairs must have shape [n, 3], got {tuple(table.shape)}")
    if offsets.shape != (layout.num_groups + 1,):
        raise ValueError(
            f"group_offsets must have shape [{layout.num_groups + 1}] (num_groups + 1), got "
            f"{tuple(offsets.shape)}"
        )
    num_pairs = table.shape[0]
    if offsets[0] != 0:
        raise ValueError(f"group_offsets[0] is {offsets[0]}, must be 0")
    steps = np.diff(offsets)
    if np.any(steps < 0):
        g = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"group_offsets decrease at group {g}: {offsets[g]} then {offsets[g + 1]}")
    if offsets[-1] != num_pairs:
        raise ValueError(
            f"group_offsets[-1] is {offsets[-1]} but pairs has {num_pairs} rows: table "
            "lengths do not match"
        )
    if num_pairs == 0:
        return
    groups = np.repeat(np.arange(layout.num_groups, dtype=np.int64), steps)
    names = ("GPU block id", "pool row", "slot")
    limits = (
        np.asarray(layout.group_num_blocks, dtype=np.int64)[groups],
        np.full(num_pairs, pool_rows, dtype=np.int64),
        np.full(num_pairs, layout.blocks_per_chunk, dtype=np.int64),
    )
    for column, (name, limit) in enumerate(zip(names, limits, strict=True)):
        values = table[:, column]
        bad = np.flatnonzero((values < 0) | (values >= limit))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{name} {values[i]} at pair {i} (group {groups[i]}) out of range [0, {limit[i]})"
            )

    _check_destinations(layout, pool_rows, table, groups, offsets, direction)


def _check_destinations(
    layout: CacheLayout,
    pool_rows: int,
    table: np.ndarray,
    groups: np.ndarray,
    offsets: np.ndarray,
    direction: Direction,
) -> None:
    """ValueError when two pairs write one destination page (vectorized, O(n log n))."""
    if direction == Direction.TO_POOL:
        # Destination page = (group, row, slot); groups whose planes share row bytes also
        # clash on the same row whatever the slot.
        bpc = layout.blocks_per_chunk
        clash = _first_duplicate(groups, table[:, 1] * bpc + table[:, 2], pool_rows * bpc)
        if clash is not None:
            i, j = clash
            raise ValueError(_pool_clash(i, j, table[j, 1], table[j, 2], groups[j]))
    else:
        clash = _first_duplicate(groups, table[:, 0], int(table[:, 0].max()) + 1)
        if clash is not None:
            i, j = clash
            raise ValueError(_cache_clash(i, j, table[j, 0], groups[j]))
        # Planes of one group never share bytes (refused by the layout) and one plane's
        # blocks never overlap, so only groups that alias cache memory can collide.
        _check_cache_aliasing(layout, table, offsets)
        return
    shared, column, what = layout.pool_shared_groups, 1, "pool row"
    if not shared:
        return
    num_groups = layout.num_groups
    conflicts = np.zeros((num_groups, num_groups), dtype=bool)
    for g, h in shared:
        conflicts[g, h] = conflicts[h, g] = True
    ids = table[:, column]
    if int(ids.max()) >= _INT64_MAX // num_groups:
        raise ValueError(f"{what} {int(ids.max())} too large to check for clashes")
    # Distinct (id, group) keys in id order: each id has at most num_groups entries, so
    # comparing every entry with the next num_groups - 1 ones finds all same-id pairs.
    keys = np.sort(ids * num_groups + groups)
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    key_ids, key_groups = keys // num_groups, keys % num_groups
    for distance in range(1, num_groups):
        a, b = slice(None, -distance), slice(distance, None)
        hit = (key_ids[a] == key_ids[b]) & conflicts[key_groups[a], key_groups[b]]
        if np.any(hit):
            k = int(np.flatnonzero(hit)[0])
            g, h = int(key_groups[k]), int(key_groups[k + distance])
            raise ValueError(_shared_clash(what, key_ids[k], g, h))


def writer_parts(
    layout: CacheLayout,
    table: PairTable,
    direction: Direction | int,
    planes: tuple[int, ...] | None,
) -> list[tuple[PairTable, tuple[int, ...] | None]]:
    """The job split by writer rotation: ``(pair table, plane subset)`` per part.

    A load, or a store whose planes all write every slot, is one part: the table and
    ``planes`` unchanged. Otherwise the planes (all when ``planes`` is None) are split
    by ``(num_writers, writer_index)`` and each class keeps only the pairs whose row
    page ``pool_row * blocks_per_chunk + slot`` it writes (``p % num_writers ==
    writer_index``); parts without a pair are dropped. A subset naming every plane of
    the layout is given as None.
    """
    if direction != Direction.TO_POOL or layout.writer_classes in ((), ((1, 0),)):
        return [(table, planes)]
    chosen = range(len(layout.planes)) if planes is None else planes
    classes: dict[tuple[int, int], list[int]] = {}
    for index in chosen:
        plane = layout.planes[index]
        classes.setdefault((plane.num_writers, plane.writer_index), []).append(index)
    if list(classes) == [(1, 0)]:
        return [(table, planes)]
    pairs, offsets = table
    num_groups = offsets.size - 1
    pages = pairs[:, 1] * layout.blocks_per_chunk + pairs[:, 2]
    groups = np.repeat(np.arange(num_groups, dtype=np.int64), np.diff(offsets))
    parts: list[tuple[PairTable, tuple[int, ...] | None]] = []
    for (writers, index), members in sorted(classes.items()):
        subset = None if len(members) == len(layout.planes) else tuple(members)
        if writers == 1:
            parts.append((table, subset))
            continue
        keep = pages % writers == index
        if not keep.any():
            continue
        kept = np.zeros(num_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(groups[keep], minlength=num_groups), out=kept[1:])
        parts.append((PairTable(np.ascontiguousarray(pairs[keep]), kept), subset))
    return parts


__all__ = [
    "DIRECTION_NAMES",
    "FROM_POOL",
    "SMALL_JOB_PAIRS",
    "TO_POOL",
    "Direction",
    "JobSpec",
    "PairTable",
    "PlainJob",
    "int64_ids",
    "pair_table",
    "plain_job",
    "plain_pair_table",
    "validate_pairs",
    "writer_parts",
]
