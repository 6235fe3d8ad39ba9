"""A CPU copy that takes its lane's copy lock only after ``shutdown`` moves no byte.

``shutdown`` takes every copy lock before it releases the pool, so a copy that holds one
finishes first. A copy that was still on its way to the lock (a whole job between the
submit's check of the books and its copy, a layer-staged load's thread) takes it after
the pool was released: it must copy nothing (its addresses point at the released pool),
be reported failed exactly once, and release every wait.

The copy is held right before the lock by a stand-in lock that stops every thread but
the test's own until the test opens it; the test's thread shuts the engine down in
between. The test keeps a reference to the pool's memory, so a late copy would be seen
as moved bytes (a poisoned destination changed) rather than as a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from triton_offload import GroupSpec, ParallelSpec, plan_offload
from triton_offload.transfer.engine import EXPEDITED_LOAD, TransferEngine, TransferResult
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec

NUM_BLOCKS = 12
HOST_BLOCKS = 6
LAYERS = 3
PAGE_BYTES = 150  # no multiple of 16
#: Seconds any wait of these tests may take: a hang fails the test instead of stalling it.
TIMEOUT_S = 10.0
#: Only a hang reaches this: a wait that is released returns at once.
HANG_GUARD_S = 120.0
# Six planes (K and V of three layers): one stage of two layers' planes, then the last.
STAGES = [[0, 1, 2, 3], [4, 5]]
JOBS = {
    "a": JobSpec([[3, 7]], [[1, 4]], [0]),
    "b": JobSpec([[0, 10, 5]], [[2, 0, 5]], [0]),
}


class HeldCopyLock:
    """One lane's copy lock, where every thread but the one that made it first says it
    arrived and then waits (at most TIMEOUT_S) until ``opened`` is set: the copy is held
    right before it takes the lock, while the test's thread (``shutdown``) passes."""

    def __init__(self, engine: TransferEngine, lane: int) -> None:
        self.lock = engine._copy_locks[lane]
        self.owner = threading.get_ident()
        self.arrived = threading.Event()
        self.opened = threading.Event()
        engine._copy_locks[lane] = self  # type: ignore[assignment]

    def __enter__(self) -> HeldCopyLock:
        if threading.get_ident() != self.owner:
            self.arrived.set()
            self.opened.wait(TIMEOUT_S)
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def make_engine(backend: str) -> TransferEngine:
    """Random caches and a random pool: any byte a copy moves changes its destination."""
    plan = plan_offload([GroupSpec("full_attention", 16)], ParallelSpec(), blocks_per_chunk=1)
    generator = torch.Generator().manual_seed(11)
    shape = (LAYERS, 2, NUM_BLOCKS, PAGE_BYTES)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    caches = [[(kv[layer, 0], kv[layer, 1]) for layer in range(LAYERS)]]
    engine = TransferEngine(plan, caches, HOST_BLOCKS, backend=backend, page_checksums=True)
    engine.pool.copy_(
        torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8, generator=generator)
    )
    return engine


def planes_snapshot(engine: TransferEngine) -> list[torch.Tensor]:
    return [plane.view.clone() for plane in engine.layout.planes]


def assert_nothing_moved(
    engine: TransferEngine,
    planes_before: list[torch.Tensor],
    pool: torch.Tensor,
    pool_before: torch.Tensor,
) -> None:
    """Byte-exact: every cache plane and the (released) pool's memory as before."""
    for index, plane in enumerate(engine.layout.planes):
        assert torch.equal(plane.view, planes_before[index]), f"plane {index} changed"
    assert torch.equal(pool, pool_before), "the released pool's memory changed"


def run_bounded(target: Callable[[], Any]) -> threading.Thread:
    """Run ``target`` on a daemon thread, joined at most TIMEOUT_S (alive: it hung)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    return thread


def reported(engine: TransferEngine, count: int) -> list[TransferResult]:
    """Poll get_finished until ``count`` results came (at most TIMEOUT_S), then once more."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(results) < count and time.monotonic() < deadline:
        results += engine.get_finished()
        time.sleep(0.01)
    assert engine.get_finished() == []  # each job once
    return results


def job_bytes(engine: TransferEngine, spec: JobSpec) -> int:
    counts = [blocks.size for blocks in spec.gpu_blocks]
    return sum(c * b for c, b in zip(counts, engine.layout.bytes_per_block, strict=True))


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_layered_load_whose_thread_takes_the_lock_after_shutdown_moves_nothing(
    backend: str, checksum: bool, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(backend)
    pool = engine.pool  # kept: the released memory stays readable, a late copy is seen
    pool_before, planes_before = pool.clone(), planes_snapshot(engine)
    held = HeldCopyLock(engine, EXPEDITED_LOAD)

    handle = engine.submit_layered_loads(list(JOBS.items()), STAGES, checksum=checksum)
    assert handle is not None
    assert held.arrived.wait(TIMEOUT_S)  # the copy thread waits right before the lock
    engine.shutdown()
    held.opened.set()

    # Every wait is released, not timed out (a wait that timed out also says False, and
    # logs that it did: no such line may appear). The limits only guard against a hang.
    handle.timeout_s = HANG_GUARD_S
    with caplog.at_level(logging.ERROR, logger="triton_offload.transfer.layered"):
        waits = [handle.wait(stage) for stage in range(len(STAGES))]
    assert not [r for r in caplog.records if "did not end within" in r.getMessage()]
    ended = handle.join()
    waiter = run_bounded(lambda: engine.wait(list(JOBS)))
    assert not waiter.is_alive(), "engine.wait hung on a job of a load after shutdown"

    assert_nothing_moved(engine, planes_before, pool, pool_before)
    assert waits == [False] * len(STAGES)
    assert ended is False and handle.failed
    results = reported(engine, len(JOBS))
    assert sorted((r.job_id, r.success) for r in results) == [("a", False), ("b", False)]
    for result in results:  # every block of the job counted in its failed result
        assert result.transfer_size == job_bytes(engine, JOBS[str(result.job_id)])
        assert result.checksums is None


@pytest.mark.parametrize(
    ("kind", "lane"),
    [("store", TO_POOL), ("load", FROM_POOL), ("expedited load", EXPEDITED_LOAD)],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_whole_job_that_takes_the_lock_after_shutdown_moves_nothing(
    backend: str, kind: str, lane: int
) -> None:
    engine = make_engine(backend)
    pool = engine.pool  # kept: a late store would write here, a late load read from here
    pool_before, planes_before = pool.clone(), planes_snapshot(engine)
    held = HeldCopyLock(engine, lane)
    spec = JOBS["b"]
    accepted: list[bool] = []

    def submit() -> None:
        if kind == "store":
            accepted.append(engine.submit_store("j", spec, checksum=True))
        else:
            expedited = kind == "expedited load"
            accepted.append(engine.submit_load("j", spec, expedited=expedited, checksum=True))

    submitter = threading.Thread(target=submit, daemon=True)
    submitter.start()
    assert held.arrived.wait(TIMEOUT_S)  # checked the books, waits right before the lock
    engine.shutdown()
    held.opened.set()
    submitter.join(TIMEOUT_S)
    assert not submitter.is_alive(), "the submit hung after shutdown"
    assert accepted == [True]  # accepted before shutdown: reported, failed

    waiter = run_bounded(lambda: engine.wait(["j"]))
    assert not waiter.is_alive(), "engine.wait hung on a job submitted before shutdown"
    assert_nothing_moved(engine, planes_before, pool, pool_before)
    (result,) = reported(engine, 1)
    assert (result.job_id, result.success, result.checksums) == ("j", False, None)
    assert result.transfer_size == job_bytes(engine, spec)
