"""HostBlockManager: LRU eviction, reference counts, rows in flight, bad input."""

from __future__ import annotations

import pytest

from triton_offload.host_blocks import HostBlockManager, LoadHandle, StoreHandle


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
