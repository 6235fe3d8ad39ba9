"""Expedited loads: ``submit_load(..., expedited=True)`` has its own lane.

A load that the caller waits on within its step (vLLM's synchronous loads) must not
queue behind regular loads. On CPU every job runs at submit, so the flag only has to
be accepted, reported once and waitable; the lane itself is checked with stand-in
streams on CPU and with real streams on a GPU (marked ``cuda``).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import pytest
import torch

from triton_offload import GroupSpec, ParallelSpec, plan_offload
from triton_offload.transfer.engine import EXPEDITED_LOAD, TransferEngine
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL

NUM_BLOCKS = 10
HOST_BLOCKS = 6
PAGE_ELEMENTS = 3 * 37  # 222-byte float16 pages: no multiple of 16


def make_plan() -> Any:
    return plan_offload([GroupSpec("full_attention", 16)], ParallelSpec(), blocks_per_chunk=1)


def make_caches(device: str, seed: int = 0) -> tuple[list, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 1 << 15, (2, NUM_BLOCKS, PAGE_ELEMENTS), generator=generator)
    kv = kv.to(torch.int16).view(torch.float16).to(device)
    return [[(kv[0], kv[1])]], kv


def page(engine: TransferEngine, plane: int, row: int) -> torch.Tensor:
    return engine.pool_view(plane)[row, 0].cpu()


def block(engine: TransferEngine, plane: int, index: int) -> torch.Tensor:
    return engine.layout.planes[plane].view[index].cpu()


def check_loaded(
    engine: TransferEngine,
    before: list[torch.Tensor],
    pool_before: torch.Tensor,
    loads: dict[int, int],
) -> None:
    """Addressed blocks hold their rows' pages, all other blocks and the pool unchanged."""
    assert torch.equal(engine.pool.cpu(), pool_before)
    for plane in range(len(engine.layout.planes)):
        for index in range(NUM_BLOCKS):
            expected = page(engine, plane, loads[index]) if index in loads else before[plane][index]
            assert torch.equal(block(engine, plane, index), expected), (plane, index)


def planes_snapshot(engine: TransferEngine) -> list[torch.Tensor]:
    return [plane.view.cpu().clone() for plane in engine.layout.planes]


def test_expedited_load_on_cpu_is_accepted_reported_once_and_waitable() -> None:
    caches, _ = make_caches("cpu")
    engine = TransferEngine(make_plan(), caches, HOST_BLOCKS, backend="torch")
    generator = torch.Generator().manual_seed(1)
    engine.pool.copy_(
        torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8, generator=generator)
    )
    pool_before = engine.pool.clone()
    before = planes_snapshot(engine)

    assert engine.submit_load("regular", gpu_blocks=[[1, 4]], host_blocks=[[0, 5]])
    assert engine.submit_load("fast", gpu_blocks=[[7, 2]], host_blocks=[[3, 0]], expedited=True)
    engine.wait(["fast"])
    engine.wait(["regular", "fast"])  # waited-on results stay for get_finished
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == ["fast", "regular"]
    assert all(r.success for r in results)
    assert engine.get_finished() == []  # each once
    check_loaded(engine, before, pool_before, {1: 0, 4: 5, 7: 3, 2: 0})
    with pytest.raises(ValueError, match="'fast' is unknown or already reported"):
        engine.wait(["fast"])

    # A bad flag is refused before anything moves; the engine stays usable.
    before = planes_snapshot(engine)
    with pytest.raises(TypeError, match="expedited must be a bool, got 'yes'"):
        engine.submit_load("bad", gpu_blocks=[[9]], host_blocks=[[1]], expedited="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expedited must be a bool, got 1"):
        engine.submit_load("bad", gpu_blocks=[[9]], host_blocks=[[1]], expedited=1)  # type: ignore[arg-type]
    check_loaded(engine, before, pool_before, {})
    assert engine.submit_load("bad", gpu_blocks=[[9]], host_blocks=[[1]], expedited=False)
    assert [r.job_id for r in engine.get_finished()] == ["bad"]
    engine.shutdown()
    assert engine.submit_load("late", gpu_blocks=[[9]], host_blocks=[[1]], expedited=True) is False


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.cuda_stream = name, log, id(self)

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", self.name, event))

    def synchronize(self) -> None:
        pass


class _Event:
    """A CUDA event stand-in: complete once ``done`` is set (``synchronize`` sets it)."""

    log: ClassVar[list] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.done = False

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", stream.name, self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _Event) -> float:
        return 1.0


def test_expedited_load_has_its_own_queue_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA submit path with stand-in streams and events (the CPU copier moves the
    bytes): an expedited load is enqueued on the expedited stream after an event of the
    caller's stream and is reported while a regular load submitted before it is pending."""
    caches, _ = make_caches("cpu")
    engine = TransferEngine(make_plan(), caches, HOST_BLOCKS, backend="torch")
    log: list = []
    _Event.log = log
    compute = _Stream("compute", log)
    engine.cuda = True
    engine._streams = {
        TO_POOL: _Stream("store", log),
        FROM_POOL: _Stream("load", log),
        EXPEDITED_LOAD: _Stream("expedited", log),
    }
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)

    def ends(stream: str) -> list[_Event]:
        return [entry[2] for entry in log if entry[:2] == ("record", stream)][1::2]

    assert engine.submit_load("slow", gpu_blocks=[[1]], host_blocks=[[0]])
    assert engine.submit_load("queued", gpu_blocks=[[2]], host_blocks=[[1]])
    mark = len(log)
    assert engine.submit_load("fast", gpu_blocks=[[3]], host_blocks=[[2]], expedited=True)
    # After the caller's stream (an event recorded there at this submit), on its own stream.
    kinds = [entry[:2] for entry in log[mark:]]
    assert kinds == [
        ("record", "compute"),
        ("wait", "expedited"),
        ("record", "expedited"),
        ("record", "expedited"),
    ]
    assert log[mark + 1][2] is log[mark][2]
    assert len(ends("load")) == 2 and len(ends("expedited")) == 1
    assert engine.get_finished() == []
    engine.wait(["fast"])  # completes the expedited end event only
    assert [r.job_id for r in engine.get_finished()] == ["fast"]
    assert not any(end.done for end in ends("load"))
    ends("load")[1].done = True  # FIFO within the regular lane: held behind "slow"
    assert engine.get_finished() == []
    ends("load")[0].done = True
    assert [r.job_id for r in engine.get_finished()] == ["slow", "queued"]
    assert engine.get_finished() == []


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "dma"])
def test_expedited_load_finishes_while_a_long_regular_load_is_queued(backend: str) -> None:
    caches, _ = make_caches("cuda")
    engine = TransferEngine(make_plan(), caches, HOST_BLOCKS, backend=backend)
    engine.pool.copy_(torch.randint(0, 256, engine.pool.shape, dtype=torch.uint8))
    pool_before = engine.pool.clone()
    before = planes_snapshot(engine)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s: the regular load waits for it
        assert engine.submit_load("slow", gpu_blocks=[[1]], host_blocks=[[0]])
    # Submitted from the idle default stream: the regular one queues behind "slow",
    # the expedited one does not.
    assert engine.submit_load("queued", gpu_blocks=[[2]], host_blocks=[[1]])
    assert engine.submit_load("fast", gpu_blocks=[[3, 5]], host_blocks=[[2, 4]], expedited=True)
    engine.wait(["fast"])
    assert [r.job_id for r in engine.get_finished()] == ["fast"]
    assert not side.query()  # the sleep still runs: "slow" and "queued" have not started
    for plane in range(len(engine.layout.planes)):
        assert torch.equal(block(engine, plane, 3), page(engine, plane, 2))
        assert torch.equal(block(engine, plane, 5), page(engine, plane, 4))
    engine.wait(["slow", "queued"])
    results = engine.get_finished()
    assert [(r.job_id, r.success) for r in results] == [("slow", True), ("queued", True)]
    check_loaded(engine, before, pool_before, {1: 0, 2: 1, 3: 2, 5: 4})
    engine.shutdown()
