"""The pinned staging ring for pair tables: reuse only after a job ended, oldest first."""

from __future__ import annotations

import pytest
import torch

from triton_offload import copiers


class _Event:
    """Stand-in for a CUDA event: done once synchronized (or marked done)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.done = name, log, False

    def query(self) -> bool:
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
