"""HostBlockManager: LRU eviction, reference counts, rows in flight, bad input."""

from __future__ import annotations

import random
import threading
import time

import pytest

from triton_offload.transfer.host_blocks import HostBlockManager, LoadHandle, StoreHandle


def _store(manager: HostBlockManager, keys: list[str], group: int = 0) -> StoreHandle:
    handle = manager.prepare_store(keys, group)
    assert handle is not None
    manager.complete_store(handle, success=True)
    return handle


def test_store_then_lookup_and_rows_are_distinct() -> None:
    manager = HostBlockManager(4)
    handle = manager.prepare_store(["a", "b", "c"], 0)
    assert handle is not None
    assert handle.keys == ("a", "b", "c")
    assert handle.indices == (0, 1, 2)
    assert len(set(handle.rows)) == 3
    assert all(0 <= r < 4 for r in handle.rows)
    # In flight: not visible to lookup, not stored twice.
    assert manager.lookup(["a", "b", "c"], 0) == [False, False, False]
    again = manager.prepare_store(["a", "d"], 0)
    assert again is not None
    assert again.keys == ("d",) and again.indices == (1,)
    assert again.rows[0] not in handle.rows
    manager.complete_store(handle, success=True)
    assert manager.lookup(["a", "b", "c", "d"], 0) == [True, True, True, False]
    # Groups are separate namespaces.
    assert manager.lookup(["a"], 1) == [False]
    assert manager.row_of("a", 0) == handle.rows[0]


def test_eviction_takes_least_recently_used_first() -> None:
    manager = HostBlockManager(3)
    first = _store(manager, ["a"])
    _store(manager, ["b"])
    _store(manager, ["c"])
    # A prepared load makes "a" most recently used: "b" becomes the oldest.
    manager.complete_load(manager.prepare_load(["a"], 0))
    handle = manager.prepare_store(["d"], 0)
    assert handle is not None
    assert handle.evicted == (("b", 0),)
    manager.complete_store(handle, success=True)
    assert manager.lookup(["a", "b", "c", "d"], 0) == [True, False, True, True]
    # touch: "c" becomes newest, so "a" goes next.
    manager.touch(["c"], 0)
    handle = manager.prepare_store(["e"], 0)
    assert handle is not None and handle.evicted == (("a", 0),)
    assert handle.rows == first.rows  # the evicted row is reused


def test_lookup_does_not_change_lru_order() -> None:
    manager = HostBlockManager(2)
    _store(manager, ["a"])
    _store(manager, ["b"])
    assert manager.lookup(["a"], 0) == [True]
    handle = manager.prepare_store(["c"], 0)
    assert handle is not None and handle.evicted == (("a", 0),)


def test_rows_in_flight_are_never_evicted() -> None:
    manager = HostBlockManager(3)
    _store(manager, ["a", "b"])
    load = manager.prepare_load(["a"], 0)  # "a" pinned by a load
    storing = manager.prepare_store(["c"], 0)  # takes the last free row, in flight
    assert storing is not None
    # Only "b" is evictable.
    handle = manager.prepare_store(["d"], 0)
    assert handle is not None and handle.evicted == (("b", 0),)
    assert handle.rows[0] not in (*load.rows, *storing.rows)
    # Nothing evictable now: "a" loading, "c" and "d" storing.
    assert manager.prepare_store(["e"], 0) is None
    manager.complete_load(load)
    handle2 = manager.prepare_store(["e"], 0)
    assert handle2 is not None and handle2.evicted == (("a", 0),)


def test_twice_pinned_row_needs_two_completions() -> None:
    manager = HostBlockManager(1)
    _store(manager, ["a"])
    first = manager.prepare_load(["a"], 0)
    second = manager.prepare_load(["a"], 0)
    manager.complete_load(first)
    assert manager.prepare_store(["b"], 0) is None
    manager.complete_load(second)
    assert manager.prepare_store(["b"], 0) is not None


def test_none_when_full_changes_nothing() -> None:
    manager = HostBlockManager(2)
    pending = manager.prepare_store(["a"], 0)
    assert pending is not None
    _store(manager, ["b"])
    # Needs two rows, only "b" is evictable: refuse without evicting "b".
    assert manager.prepare_store(["c", "d"], 0) is None
    assert manager.lookup(["b"], 0) == [True]
    assert len(manager) == 2
    # Keys already stored need no row: this succeeds with nothing to evict.
    handle = manager.prepare_store(["b"], 0)
    assert handle is not None and handle.keys == () and handle.evicted == ()


def test_failed_store_frees_its_rows() -> None:
    manager = HostBlockManager(2)
    handle = manager.prepare_store(["a", "b"], 0)
    assert handle is not None
    assert manager.num_free_rows == 0
    manager.complete_store(handle, success=False)
    assert manager.num_free_rows == 2
    assert len(manager) == 0
    assert manager.lookup(["a", "b"], 0) == [False, False]
    again = manager.prepare_store(["a", "b"], 0)
    assert again is not None and sorted(again.rows) == [0, 1] and again.evicted == ()


def test_load_of_missing_or_storing_key_pins_nothing() -> None:
    manager = HostBlockManager(2)
    _store(manager, ["a"])
    pending = manager.prepare_store(["b"], 0)
    assert pending is not None
    with pytest.raises(ValueError, match="'x'"):
        manager.prepare_load(["a", "x"], 0)
    with pytest.raises(ValueError, match=r"'b'.*being stored"):
        manager.prepare_load(["a", "b"], 0)
    # "a" was not pinned by the failed calls: it can be evicted.
    manager.complete_store(pending, success=True)
    manager.touch(["b"], 0)
    handle = manager.prepare_store(["c"], 0)
    assert handle is not None and handle.evicted == (("a", 0),)


def test_clear_forgets_everything_but_not_while_in_flight() -> None:
    manager = HostBlockManager(2)
    _store(manager, ["a"])
    load = manager.prepare_load(["a"], 0)
    with pytest.raises(RuntimeError, match="1 load"):
        manager.clear()
    manager.complete_load(load)
    manager.clear()
    assert manager.lookup(["a"], 0) == [False]
    assert manager.num_free_rows == 2


def test_drop_frees_stored_rows_but_not_rows_in_use() -> None:
    manager = HostBlockManager(5)
    stored = _store(manager, ["a", "b", "c"])
    _store(manager, ["a"], group=1)
    load = manager.prepare_load(["c"], 0)
    pending = manager.prepare_store(["d"], 0)
    assert pending is not None
    # "x" is unknown (ignored); "c" is being loaded and "d" stored: both stay, returned.
    assert manager.drop(["d", "a", "x", "c"], 0) == ["d", "c"]
    assert manager.lookup(["a", "b", "c"], 0) == [False, True, True]
    assert manager.row_of("a", 0) is None
    assert manager.lookup(["a"], 1) == [True]  # another group's chunk of that key stays
    assert manager.num_free_rows == 1  # of 5 rows: b, c, d, group 1's a in use
    with pytest.raises(ValueError, match="'a' of group 0 is not stored"):
        manager.prepare_load(["a"], 0)
    # Once the load and the store finished, they can be dropped too.
    manager.complete_load(load)
    manager.complete_store(pending, success=True)
    assert manager.drop(["c", "d"], 0) == []
    assert manager.lookup(["b", "c", "d"], 0) == [True, False, False]
    assert manager.num_free_rows == 3
    # A dropped key is stored afresh (not skipped as already stored), into a free row.
    again = _store(manager, ["a"])
    assert again.keys == ("a",) and again.evicted == ()
    assert set(again.rows) <= set(stored.rows) | {pending.rows[0]}
    with pytest.raises(TypeError, match="sequence of chunk keys"):
        manager.drop("a", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="-1"):
        manager.drop(["a"], -1)


@pytest.mark.parametrize("num_rows", [0, -3])
def test_bad_num_rows(num_rows: int) -> None:
    with pytest.raises(ValueError, match=str(num_rows)):
        HostBlockManager(num_rows)


def test_bad_input_names_the_value() -> None:
    with pytest.raises(TypeError, match=r"2\.5"):
        HostBlockManager(2.5)  # type: ignore[arg-type]
    manager = HostBlockManager(4)
    with pytest.raises(ValueError, match="-1"):
        manager.lookup(["a"], -1)
    with pytest.raises(TypeError, match="'g'"):
        manager.prepare_store(["a"], "g")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\[1\]"):
        manager.prepare_store([[1]], 0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'abc'"):
        manager.lookup("abc", 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        manager.prepare_store(["a", "a"], 0)
    assert len(manager) == 0


def test_handles_complete_once() -> None:
    manager = HostBlockManager(2)
    store = manager.prepare_store(["a"], 0)
    assert store is not None
    manager.complete_store(store, success=True)
    with pytest.raises(ValueError, match=f"store handle {store.handle_id}"):
        manager.complete_store(store, success=True)
    load = manager.prepare_load(["a"], 0)
    manager.complete_load(load)
    with pytest.raises(ValueError, match=f"load handle {load.handle_id}"):
        manager.complete_load(load)
    with pytest.raises(TypeError, match="LoadHandle"):
        manager.complete_load(store)  # type: ignore[arg-type]
    forged = LoadHandle(handle_id=load.handle_id, group=0, keys=("a",), rows=(0,))
    with pytest.raises(ValueError, match="not pending"):
        manager.complete_load(forged)


def test_store_never_evicts_a_key_it_was_asked_to_store() -> None:
    # Full pool holding "a" (the oldest) and "b": storing ["a", "c"] needs one row.
    # "a" is already stored, so it is skipped; evicting it for "c" would lose a chunk
    # the same call asked to keep.
    manager = HostBlockManager(2)
    _store(manager, ["a"])
    _store(manager, ["b"])
    handle = manager.prepare_store(["a", "c"], 0)
    assert handle is not None
    assert handle.keys == ("c",) and handle.indices == (1,)
    assert handle.evicted == (("b", 0),)
    manager.complete_store(handle, success=True)
    assert manager.lookup(["a", "b", "c"], 0) == [True, False, True]


def test_store_of_a_prefix_keeps_the_prefix() -> None:
    # A request stores its chunks c0..c2 while c0 is the oldest entry: it must end up
    # with all three stored, not with c1, c2 and a hole at c0.
    manager = HostBlockManager(3)
    _store(manager, ["c0"])
    _store(manager, ["x"])
    _store(manager, ["y"])
    handle = manager.prepare_store(["c0", "c1", "c2"], 0)
    assert handle is not None
    assert set(handle.evicted) == {("x", 0), ("y", 0)}
    manager.complete_store(handle, success=True)
    assert manager.lookup(["c0", "c1", "c2"], 0) == [True, True, True]


def test_store_needing_its_own_keys_refuses_and_changes_nothing() -> None:
    # One row, holding "a": storing ["a", "b"] could only get a row by evicting "a".
    manager = HostBlockManager(1)
    _store(manager, ["a"])
    assert manager.prepare_store(["a", "b"], 0) is None
    assert manager.lookup(["a", "b"], 0) == [True, False]
    # A key of the same name in another group is a different chunk: evictable.
    handle = manager.prepare_store(["a"], 1)
    assert handle is not None and handle.evicted == (("a", 0),)


def test_already_stored_keys_of_a_store_become_most_recently_used() -> None:
    manager = HostBlockManager(3)
    _store(manager, ["a"])
    _store(manager, ["b"])
    _store(manager, ["c"])
    handle = manager.prepare_store(["a"], 0)  # nothing to write: "a" is stored
    assert handle is not None and handle.keys == ()
    manager.complete_store(handle, success=True)
    # "b" is now the oldest.
    handle = manager.prepare_store(["d"], 0)
    assert handle is not None and handle.evicted == (("b", 0),)


def test_key_being_loaded_is_never_evicted_by_a_store_naming_it() -> None:
    manager = HostBlockManager(2)
    _store(manager, ["a"])
    _store(manager, ["b"])
    load = manager.prepare_load(["b"], 0)
    handle = manager.prepare_store(["b", "c"], 0)
    assert handle is not None and handle.evicted == (("a", 0),)
    assert handle.rows[0] not in load.rows
    manager.complete_store(handle, success=True)
    manager.complete_load(load)
    assert manager.lookup(["a", "b", "c"], 0) == [False, True, True]


def test_capacity_does_not_cost_memory() -> None:
    # Rows are handed out from a lazily extended free list: a huge pool builds at once.
    manager = HostBlockManager(10**15)
    assert manager.num_rows == manager.num_free_rows == 10**15
    handle = manager.prepare_store(["a", "b"], 0)
    assert handle is not None and handle.rows == (0, 1)
    assert manager.num_free_rows == 10**15 - 2
    manager.complete_store(handle, success=False)
    assert manager.num_free_rows == 10**15
    manager.clear()
    assert manager.num_free_rows == 10**15


def test_rows_are_handed_out_in_order_then_recycled() -> None:
    manager = HostBlockManager(4)
    first = manager.prepare_store(["a", "b"], 0)
    assert first is not None and first.rows == (0, 1)
    manager.complete_store(first, success=False)  # rows 0 and 1 go back
    second = manager.prepare_store(["c", "d", "e", "f"], 0)
    assert second is not None and second.rows == (2, 3, 0, 1)
    assert manager.num_free_rows == 0


@pytest.mark.parametrize("success", ["False", "True", 0, 1, None, 1.0])
def test_complete_store_success_must_be_a_bool(success: object) -> None:
    manager = HostBlockManager(2)
    handle = manager.prepare_store(["a"], 0)
    assert handle is not None
    with pytest.raises(TypeError, match=rf"success must be a bool, got {success!r}"):
        manager.complete_store(handle, success=success)  # type: ignore[arg-type]
    # Refused before anything changed: the handle is still pending and completes.
    assert manager.lookup(["a"], 0) == [False]
    manager.complete_store(handle, success=True)
    assert manager.lookup(["a"], 0) == [True]


class _YieldingKey:
    """A chunk key whose hash gives up the GIL: any dict lookup inside the manager
    becomes a point where another thread runs, so a missing lock shows up as a row
    handed out twice or an IndexError instead of passing by luck."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        time.sleep(0)
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _YieldingKey) and other.value == self.value

    def __repr__(self) -> str:
        return f"K{self.value}"


def test_concurrent_callers_keep_the_books_consistent() -> None:
    """Several threads storing, loading and completing at once: every row belongs to
    at most one entry, a row being stored is never pinned by a load nor handed to a
    second store, and the counts add up."""
    num_rows = 16
    manager = HostBlockManager(num_rows)
    keys_pool = [_YieldingKey(i) for i in range(24)]
    errors: list[BaseException] = []
    pinned_rows: dict[int, int] = {}  # row -> loads in flight (judged independently)
    storing_rows: set[int] = set()
    books = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                group = rng.randrange(2)
                keys = rng.sample(keys_pool, rng.randint(1, 3))
                if rng.random() < 0.5:
                    store = manager.prepare_store(keys, group)
                    if store is None:
                        continue
                    with books:
                        for row in store.rows:
                            assert row not in storing_rows and row not in pinned_rows, row
                            storing_rows.add(row)
                    time.sleep(0)
                    with books:
                        storing_rows.difference_update(store.rows)
                    manager.complete_store(store, success=rng.random() < 0.8)
                else:
                    present = manager.lookup(keys, group)
                    ready = [k for k, p in zip(keys, present, strict=True) if p]
                    try:
                        load = manager.prepare_load(ready, group)
                    except ValueError:
                        continue  # evicted between lookup and load by another thread
                    with books:
                        for row in load.rows:
                            assert row not in storing_rows, row
                            pinned_rows[row] = pinned_rows.get(row, 0) + 1
                    time.sleep(0)
                    with books:
                        for row in load.rows:
                            pinned_rows[row] -= 1
                            if not pinned_rows[row]:
                                del pinned_rows[row]
                    manager.complete_load(load)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, repr(errors[0])
    rows = [manager.row_of(k, g) for g in range(2) for k in keys_pool]
    held = [r for r in rows if r is not None]
    assert len(held) == len(set(held)) == len(manager)
    assert len(manager) + manager.num_free_rows == num_rows
    manager.clear()
