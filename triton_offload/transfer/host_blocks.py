"""Host-pool row bookkeeping for engines that are not vLLM.

``HostBlockManager`` answers the scheduler-side questions an offloading connector
asks about the host pool: which chunks are stored (``lookup``), which rows a new
store may write (``prepare_store`` / ``complete_store``) and which rows a load
reads (``prepare_load`` / ``complete_load``). It never touches bytes: the rows it
hands out are the ``host_blocks`` a caller passes to ``TransferEngine``.

Entries are keyed by ``(chunk key, group)``: one pool row holds one chunk of one
cache group (see ``TransferEngine``). A chunk key is any hashable value that names
the chunk's contents; a hash of the token prefix up to the chunk's end is the usual
choice, so that a longer prompt sharing the prefix finds the stored chunks.

Row life cycle::

    free --prepare_store--> storing --complete_store(True)--> stored (LRU, refcount 0)
                                    --complete_store(False)-> free
    stored --prepare_load--> stored, refcount + 1 --complete_load--> refcount - 1
    stored, refcount 0 --evicted by a later prepare_store--> storing (new key)
    stored, refcount 0 --drop--> free

A row being stored (not yet completed) or loaded (refcount > 0) is never evicted
and never handed out to another store, so a transfer in flight cannot have its row
overwritten. Eviction takes the least recently used stored row first, but never a
chunk the same ``prepare_store`` names; stores that complete, stores that name an
already stored chunk and loads that are prepared (and ``touch``) make a chunk most
recently used. ``lookup`` is a pure query and does not change the order. Rows are
handed out lazily, so ``num_rows`` costs no memory until rows are used.

Typical serving loop (one manager per scheduler, shared by every rank's engine)::

    present = [manager.lookup(keys[g], g) for g in range(num_groups)]
    hit = plan.lookup(num_tokens, 0, present)
    lo, top = plan.groups[g].needed_chunks(hit)              # the chunks the hit reads
    handle = manager.prepare_load(keys[g][lo:top], g)        # pins the rows
    engine.submit_load(job, JobSpec(gpu_blocks, [handle.rows, ...], first_block_index))
    ... wait ...
    manager.complete_load(handle)                            # unpins

    chunks = plan.store_reachable_chunks(g, plan.storable_chunk_count(g, num_tokens))
    handle = manager.prepare_store([keys[g][i] for i in chunks], g)  # None: pool full
    engine.submit_store(job, JobSpec(gpu_blocks, [handle.rows, ...], first_block_index))
    ... wait ...
    manager.complete_store(handle, success=result.success)

Thread safety: every public method may be called from any thread. Each call runs
under one lock, so it sees and leaves the books consistent (a row belongs to at most
one entry, rows in flight are never handed out or evicted). Calls are not
transactions across each other: a chunk ``lookup`` reports present may be evicted by
another thread's ``prepare_store`` before this thread's ``prepare_load``, which then
raises ValueError naming the key.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["HostBlockManager", "LoadHandle", "StoreHandle"]


@dataclass(frozen=True)
class StoreHandle:
    """Rows granted by ``HostBlockManager.prepare_store``.

    ``keys[i]`` is to be written to pool row ``rows[i]``; ``indices[i]`` is the
    position of ``keys[i]`` in the sequence passed to ``prepare_store`` (keys that
    were already stored or being stored are skipped, so positions may have gaps).
    ``evicted`` lists the ``(key, group)`` entries dropped to make room.
    """

    handle_id: int
    group: int
    keys: tuple[Hashable, ...]
    rows: tuple[int, ...]
    indices: tuple[int, ...]
    evicted: tuple[tuple[Hashable, int], ...]


@dataclass(frozen=True)
class LoadHandle:
    """Rows pinned by ``HostBlockManager.prepare_load``: ``keys[i]`` is in ``rows[i]``."""

    handle_id: int
    group: int
    keys: tuple[Hashable, ...]
    rows: tuple[int, ...]


@dataclass
class _Entry:
    row: int
    ready: bool  # False while its store is in flight
    refcount: int = 0  # loads in flight


class HostBlockManager:
    """Maps ``(chunk key, group)`` to host-pool rows with LRU eviction and reference counts.

    Args:
        num_rows: rows in the host pool (``TransferEngine``'s ``num_host_blocks``).
            The manager's own memory grows with the rows in use, not with
            ``num_rows``: rows never used yet are handed out from a counter.
    """

    def __init__(self, num_rows: int) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int):
            raise TypeError(f"num_rows must be an int, got {num_rows!r}")
        if num_rows < 1:
            raise ValueError(f"num_rows must be at least 1, got {num_rows}")
        self._num_rows = num_rows
        # Free rows: the never-used rows [_fresh, num_rows) first, then rows given back
        # (oldest first). A list of every row up front made a pool of 10**15 rows
        # (a byte-sized pool given as rows by mistake) hang, then run out of memory.
        self._fresh = 0
        self._recycled: deque[int] = deque()
        # (key, group) -> entry; iteration order is LRU (oldest first).
        self._entries: OrderedDict[tuple[Hashable, int], _Entry] = OrderedDict()
        self._stores: dict[int, StoreHandle] = {}
        self._loads: dict[int, LoadHandle] = {}
        self._ids = itertools.count()
        # One lock for every public call: a scheduler thread and a completion thread
        # may share a manager. Reentrant so that methods can call each other.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def num_free_rows(self) -> int:
        """Rows holding nothing (evictable stored rows are not counted)."""
        with self._lock:
            return self._num_free()

    def __len__(self) -> int:
        """Entries stored or being stored."""
        with self._lock:
            return len(self._entries)

    def lookup(self, keys: Sequence[Hashable], group: int) -> list[bool]:
        """Per key: is the chunk stored and complete (a load may read it now)?

        A chunk whose store is still in flight reports False. The result is the
        ``present[group]`` argument of ``OffloadPlan.lookup`` when ``keys`` lists the
        group's chunks from chunk 0. Does not change the LRU order.
        """
        self._check_group(group)
        checked = _checked_keys(keys)
        with self._lock:
            out = []
            for key in checked:
                entry = self._entries.get((key, group))
                out.append(entry is not None and entry.ready)
            return out

    def row_of(self, key: Hashable, group: int) -> int | None:
        """The row holding a stored or being-stored chunk, else None."""
        self._check_group(group)
        checked = _checked_key(key)
        with self._lock:
            entry = self._entries.get((checked, group))
            return None if entry is None else entry.row

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[Hashable], group: int) -> StoreHandle | None:
        """Reserve rows for the keys of ``group`` that are neither stored nor being stored.

        Evicts least recently used stored rows that no load holds when the free rows
        do not suffice, but never a chunk this call names: a request storing chunks
        ``c0..c2`` while ``c0`` is the oldest entry would otherwise lose ``c0`` to make
        room for ``c1`` and keep no usable prefix. The named chunks that are already
        stored become most recently used. Returns None, changing nothing, when even
        eviction cannot provide enough rows. The granted rows are invisible to
        ``lookup`` and safe from eviction until ``complete_store``.
        """
        self._check_group(group)
        checked = _checked_keys(keys)
        _reject_duplicates(checked)
        with self._lock:
            wanted = [(i, k) for i, k in enumerate(checked) if (k, group) not in self._entries]
            shortfall = len(wanted) - self._num_free()
            victims: list[tuple[Hashable, int]] = []
            if shortfall > 0:
                named = {(k, group) for k in checked}
                for entry_key, entry in self._entries.items():  # oldest first
                    if entry.ready and entry.refcount == 0 and entry_key not in named:
                        victims.append(entry_key)
                        if len(victims) == shortfall:
                            break
                if len(victims) < shortfall:
                    return None
            for victim in victims:
                self._recycled.append(self._entries.pop(victim).row)
            for key in checked:
                if (key, group) in self._entries:
                    self._entries.move_to_end((key, group))
            rows = []
            for _, key in wanted:
                row = self._take_free_row()
                self._entries[(key, group)] = _Entry(row=row, ready=False)
                rows.append(row)
            handle = StoreHandle(
                handle_id=next(self._ids),
                group=group,
                keys=tuple(k for _, k in wanted),
                rows=tuple(rows),
                indices=tuple(i for i, _ in wanted),
                evicted=tuple(victims),
            )
            self._stores[handle.handle_id] = handle
            return handle

    def complete_store(self, handle: StoreHandle, success: bool) -> None:
        """Finish a store: on success the chunks become visible (most recently used);
        on failure their rows return to the free list and the keys are forgotten.

        ``success`` must be a bool: a string such as ``"False"`` is truthy and would
        publish rows whose store failed.
        """
        handle_id = _handle_id(handle, StoreHandle)
        if not isinstance(success, bool):
            raise TypeError(f"success must be a bool, got {success!r} ({type(success).__name__})")
        with self._lock:
            if self._stores.get(handle_id) is not handle:
                raise ValueError(f"store handle {handle_id} is not pending")
            del self._stores[handle_id]
            for key, row in zip(handle.keys, handle.rows, strict=True):
                entry = self._entries[(key, handle.group)]
                assert entry.row == row and not entry.ready, (key, handle.group)
                if success:
                    entry.ready = True
                    self._entries.move_to_end((key, handle.group))
                else:
                    del self._entries[(key, handle.group)]
                    self._recycled.append(row)

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[Hashable], group: int) -> LoadHandle:
        """Pin the rows of stored chunks for a load (reference count + 1 each).

        Raises ValueError naming the first key that is not stored or whose store is
        still in flight; nothing is pinned then. Pinned rows are never evicted.
        """
        self._check_group(group)
        checked = _checked_keys(keys)
        _reject_duplicates(checked)
        with self._lock:
            entries = []
            for key in checked:
                entry = self._entries.get((key, group))
                if entry is None:
                    raise ValueError(f"chunk key {key!r} of group {group} is not stored")
                if not entry.ready:
                    raise ValueError(f"chunk key {key!r} of group {group} is still being stored")
                entries.append(entry)
            for key, entry in zip(checked, entries, strict=True):
                entry.refcount += 1
                self._entries.move_to_end((key, group))
            handle = LoadHandle(
                handle_id=next(self._ids),
                group=group,
                keys=tuple(checked),
                rows=tuple(e.row for e in entries),
            )
            self._loads[handle.handle_id] = handle
            return handle

    def complete_load(self, handle: LoadHandle) -> None:
        """Unpin the rows of a finished load (success or not: the host copy is intact)."""
        handle_id = _handle_id(handle, LoadHandle)
        with self._lock:
            if self._loads.get(handle_id) is not handle:
                raise ValueError(f"load handle {handle_id} is not pending")
            del self._loads[handle_id]
            for key in handle.keys:
                entry = self._entries[(key, handle.group)]
                assert entry.refcount > 0, (key, handle.group)
                entry.refcount -= 1

    # ------------------------------------------------------------------ upkeep
    def touch(self, keys: Sequence[Hashable], group: int) -> None:
        """Mark stored chunks most recently used; unknown keys are ignored."""
        self._check_group(group)
        checked = _checked_keys(keys)
        with self._lock:
            for key in checked:
                if (key, group) in self._entries:
                    self._entries.move_to_end((key, group))

    def drop(self, keys: Sequence[Hashable], group: int) -> list[Hashable]:
        """Forget stored chunks whose host bytes must not be read again (a chunk refused by
        its seal, say): their rows return to the free list at once, and ``lookup`` reports
        them absent, so a later store writes them afresh.

        Keys that are not stored are ignored. A chunk whose store is still in flight or
        that a load holds (its row is in use) stays; such keys are returned, in the order
        given, for the caller to drop again once that finished.
        """
        self._check_group(group)
        checked = _checked_keys(keys)
        with self._lock:
            busy = []
            for key in checked:
                entry = self._entries.get((key, group))
                if entry is None:
                    continue
                if not entry.ready or entry.refcount > 0:
                    busy.append(key)
                    continue
                del self._entries[(key, group)]
                self._recycled.append(entry.row)
            return busy

    def clear(self) -> None:
        """Forget every stored chunk and free all rows.

        Raises RuntimeError while a store or load is pending: its row is in use.
        """
        with self._lock:
            if self._stores or self._loads:
                raise RuntimeError(
                    f"cannot clear: {len(self._stores)} store(s) and {len(self._loads)} "
                    "load(s) pending"
                )
            self._entries.clear()
            self._fresh = 0
            self._recycled.clear()

    def _num_free(self) -> int:
        return self._num_rows - self._fresh + len(self._recycled)

    def _take_free_row(self) -> int:
        if self._fresh < self._num_rows:
            self._fresh += 1
            return self._fresh - 1
        return self._recycled.popleft()

    @staticmethod
    def _check_group(group: int) -> None:
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"group must be an int, got {group!r}")
        if group < 0:
            raise ValueError(f"group must be non-negative, got {group}")


def _checked_key(key: Hashable) -> Hashable:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"chunk key {key!r} is not hashable") from None
    return key


def _checked_keys(keys: Sequence[Hashable]) -> list[Hashable]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a sequence of chunk keys, got {keys!r}")
    return [_checked_key(k) for k in keys]


def _reject_duplicates(keys: list[Hashable]) -> None:
    seen: set[Hashable] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"chunk key {key!r} appears twice")
        seen.add(key)


def _handle_id(handle: object, kind: type[StoreHandle] | type[LoadHandle]) -> int:
    if not isinstance(handle, kind):
        raise TypeError(f"expected a {kind.__name__}, got {handle!r}")
    return handle.handle_id
