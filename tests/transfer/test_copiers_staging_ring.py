"""The pinned staging ring for pair tables: reuse only after a job ended, oldest first."""

from __future__ import annotations

import pytest
import torch

from triton_offload.transfer import copiers


class _Event:
    """Stand-in for a CUDA event: done once synchronized (or marked done)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.done = name, log, False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.done = True


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    # pin_memory needs CUDA; the ring's logic does not.
    monkeypatch.setattr(copiers, "_pinned_int64", lambda n: torch.empty(n, dtype=torch.int64))


def test_a_buffer_is_reused_only_after_its_job_ended() -> None:
    ring = copiers.StagingRing(limit=4)
    log: list[str] = []
    first, _ = ring.acquire(8)
    ring.release_after(first, _Event("a", log))
    second, _ = ring.acquire(8)
    assert second != first  # a's job is still running
    ring.release_after(second, _Event("b", log))
    ring.events[first].done = True
    third, _ = ring.acquire(8)
    assert third == first and log == []


def test_when_every_buffer_is_busy_it_waits_for_the_oldest_job() -> None:
    ring = copiers.StagingRing(limit=2)
    log: list[str] = []
    index_a, _ = ring.acquire(8)
    ring.release_after(index_a, _Event("a", log))
    index_b, _ = ring.acquire(8)
    ring.release_after(index_b, _Event("b", log))
    reused, _ = ring.acquire(8)  # both busy: waits for a, the oldest
    assert log == ["a"] and reused == index_a
    ring.release_after(reused, _Event("c", log))
    again, _ = ring.acquire(8)  # b is now the oldest running job, not c in buffer 0
    assert log == ["a", "b"] and again == index_b


def test_a_larger_table_grows_the_buffer() -> None:
    ring = copiers.StagingRing(limit=1)
    index, _ = ring.acquire(8)
    ring.release_after(index, None)
    index, large = ring.acquire(5000)
    assert large.numel() == 5000


def test_a_job_asks_only_the_oldest_busy_buffer() -> None:
    """Jobs end in submit order per stream: if the oldest busy buffer's job has not
    ended, a newer one has not either; one event query per job, not one per buffer."""
    ring = copiers.StagingRing(limit=64)
    log: list[str] = []
    events = []
    for name in "abcdefghij":
        index, _ = ring.acquire(8)
        events.append(_Event(name, log))
        ring.release_after(index, events[-1])
    for event in events:
        event.queries = 0
    fresh, _ = ring.acquire(8)  # nothing ended: a new buffer, after one query
    assert fresh == 10 and sum(e.queries for e in events) == 1 and events[0].queries == 1
    ring.release_after(fresh, _Event("k", log))
    events[0].done = True
    reused, _ = ring.acquire(8)  # the oldest ended: its buffer, again one query
    assert reused == 0 and sum(e.queries for e in events) == 2 and log == []


def test_a_buffer_acquired_but_not_yet_released_is_not_handed_out_again() -> None:
    """One job may stage twice (its pair table and a new subset's kernel tables)."""
    ring = copiers.StagingRing(limit=4)
    first, a = ring.acquire(8)
    second, b = ring.acquire(8)
    assert first != second and a.data_ptr() != b.data_ptr()


def test_when_every_buffer_is_busy_an_ended_newer_one_is_taken_before_waiting() -> None:
    """Stores and loads end independently: at the limit, a newer buffer of the other
    stream that already ended is reused rather than blocking on the oldest."""
    ring = copiers.StagingRing(limit=2)
    log: list[str] = []
    index_a, _ = ring.acquire(8)
    ring.release_after(index_a, _Event("a", log))
    index_b, _ = ring.acquire(8)
    event_b = _Event("b", log)
    ring.release_after(index_b, event_b)
    event_b.done = True
    reused, _ = ring.acquire(8)
    assert reused == index_b and log == []
