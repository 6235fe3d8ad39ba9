"""Table uploads on the CUDA submit path, without a GPU: order, no host wait, stream waits.

Streams and events are stand-ins that log what is enqueued where; ``torch.cuda.stream``
makes its stream the current one, as the real context does. The kernel is a stand-in
module that copies with the CPU path (the planes of the tables it is given), and the
upload of staged words is logged with the stream it was enqueued on. Checked:

- a job's pair table is uploaded on its transfer stream *before* that stream waits for
  the compute stream (it reads no cache byte, so it overlaps compute), and the job's
  start event follows both; its staging buffer is released after the job's end event;
- the kernel tables of a plane subset first used while serving are uploaded from pinned
  staging on the job's stream with no host synchronisation, and any other stream that
  uses them waits once on an event recorded after that upload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from tests.helpers.hybrid_engine import (
    expected_store,
    hybrid_caches,
    make_engine,
    raw_bytes,
    same_bytes,
    snapshot,
    store_job,
)
from triton_offload.transfer import copiers, cpu_copy
from triton_offload.transfer.copiers import HostCopier, JobHolds, TritonCopier, kernel_tables
from triton_offload.transfer.jobs import FROM_POOL, JobSpec
from triton_offload.transfer.selection import Crossover, CrossoverPath, FixedPath


class _Stream:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log, self.cuda_stream = name, log, id(self)

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", self.name, event))

    def synchronize(self) -> None:
        self.log.append(("host sync", self.name))


class _Event:
    log: ClassVar[list[tuple[Any, ...]]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.done = False

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", stream.name, self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("host sync", "event"))
        self.done = True

    def elapsed_time(self, end: _Event) -> float:
        return 1.0


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """A CPU engine whose triton copier runs the CUDA path on stand-in streams."""
    caches, storages = hybrid_caches(seed=31)
    engine = make_engine(caches, 1, "torch")
    log: list[tuple[Any, ...]] = []
    _Event.log = log
    compute = _Stream("compute", log)
    current = [compute]

    @contextlib.contextmanager
    def stream_context(stream: _Stream) -> Iterator[None]:
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    def launch(tables: Any, pairs: torch.Tensor, offsets: torch.Tensor, *args: Any, **kw: Any):
        log.append(("launch", current[-1].name, tables.planes))
        cpu_copy.copy_pages(
            engine.layout,
            engine.pool_address,
            engine.row_stride,
            pairs.numpy(),
            offsets.numpy(),
            args[1],
            planes=None if len(tables.planes) == len(engine.layout.planes) else tables.planes,
        )

    upload = copiers._upload

    def logged_upload(words: torch.Tensor, device: torch.device) -> torch.Tensor:
        log.append(("upload", current[-1].name, words.numel()))
        return upload(words, device)

    kernels = SimpleNamespace(
        TILE_BYTES=64, launch_copy=launch, default_num_programs=lambda device, tile: 4
    )
    monkeypatch.setattr(copiers, "_pinned_int64", lambda n: torch.empty(n, dtype=torch.int64))
    monkeypatch.setattr(copiers, "_upload", logged_upload)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: log.append(("host sync", "device"))
    )
    triton = TritonCopier(
        engine.layout,
        engine.pool_address,
        engine.row_stride,
        device=engine.device,
        cuda=True,
        kernels=kernels,  # type: ignore[arg-type]
    )
    engine.cuda = True
    engine._streams = {0: _Stream("store", log), 1: _Stream("load", log)}
    engine.copiers = {
        "triton": triton,
        "dma": HostCopier(engine.layout, engine.pool_address, engine.row_stride),
    }
    log.clear()
    yield SimpleNamespace(engine=engine, triton=triton, log=log, storages=storages, caches=caches)
    del storages


def _finish(engine: Any, log: list[tuple[Any, ...]]) -> list[Any]:
    for entry in log:
        if entry[0] == "record":
            entry[2].done = True
    return engine.get_finished()


def _kinds(log: list[tuple[Any, ...]]) -> list[tuple[str, str]]:
    return [(entry[0], entry[1]) for entry in log]


def test_the_pair_table_upload_comes_before_the_compute_wait(stand_in: SimpleNamespace) -> None:
    engine, triton, log = stand_in.engine, stand_in.triton, stand_in.log
    engine.policy = FixedPath("triton")
    gpu, host, first = store_job(1)
    assert engine.submit_store("a", JobSpec(gpu, host, first))
    assert _kinds(log) == [
        ("record", "compute"),  # at submit: what the caller's stream enqueued so far
        ("upload", "store"),  # the pair table, on the transfer stream, before the wait
        ("wait", "store"),
        ("record", "store"),  # start: after the host work, the upload and the wait
        ("launch", "store"),
        ("record", "store"),  # end
    ]
    ready, end = log[0][2], log[-1][2]
    assert log[2][2] is ready
    # The staging buffer is released after the job's end event, not its start.
    assert triton.staging.events == [end]
    engine.submit_store("b", JobSpec([[0], [], []], [[4], [], []]))
    assert len(triton.staging.buffers) == 2  # a's buffer is busy until a ended
    results = _finish(engine, log)
    assert [r.job_id for r in results] == ["a", "b"] and all(r.success for r in results)
    engine.submit_store("c", JobSpec([[0], [], []], [[4], [], []]))
    assert len(triton.staging.buffers) == 2
    assert not [entry for entry in log if entry[0] == "host sync"]


def test_a_new_plane_subset_while_serving_waits_for_nothing_on_the_host(
    stand_in: SimpleNamespace,
) -> None:
    engine, triton, log = stand_in.engine, stand_in.triton, stand_in.log
    # DMA for the 528-byte SSM planes, the kernel for the rest: a subset's tables.
    engine.policy = CrossoverPath(engine.layout, Crossover(threshold={0: 500, 1: 500}), "plane")
    small = tuple(i for i, p in enumerate(engine.layout.planes) if p.page_bytes < 500)
    gpu, host, first = store_job(1)
    job = JobSpec(gpu, host, first)
    engine.pool.fill_(0xA5)
    pool_before = engine.pool.clone()
    assert engine.submit_store("s", job)
    assert engine.last_job_backend == "dma+triton"
    assert not [entry for entry in log if entry[0] == "host sync"]
    uploads = [entry for entry in log if entry[0] == "upload"]
    # The subset's tables, then the pair table: both on the store stream.
    assert [entry[1] for entry in uploads] == ["store", "store"]
    tables = triton._subsets[small]
    expected = kernel_tables(engine.layout, engine.row_stride, 64, torch.device("cpu"), small)
    assert tables.planes == small
    assert torch.equal(tables.tile_table, expected.tile_table)
    assert torch.equal(tables.group_table, expected.group_table)
    tables_ready = log[log.index(uploads[0]) + 1]
    assert tables_ready[:2] == ("record", "store")
    assert [r.success for r in _finish(engine, log)] == [True]
    assert torch.equal(engine.pool, expected_store(engine, pool_before, *engine.last_job_table))

    # The load stream first uses the subset: it waits once on the event recorded after
    # the upload, before its launch; the store stream, which uploaded, never waits on it.
    storages = stand_in.storages
    for tensor in storages:  # poison the caches: the load must bring the pages back
        raw_bytes(tensor).fill_(0x3C)
    poisoned = snapshot(storages)
    log.clear()
    assert engine.submit_load("l", job)
    waits = [entry for entry in log if entry[0] == "wait"]
    assert waits[0] == ("wait", "load", tables_ready[2])
    assert log.index(waits[0]) < _kinds(log).index(("launch", "load"))
    assert [r.success for r in _finish(engine, log)] == [True]
    loaded = snapshot(storages)
    # The reference: the CPU path loading every plane of the same table.
    for tensor, copy in zip(storages, poisoned, strict=True):
        raw_bytes(tensor).copy_(copy)
    reference = HostCopier(engine.layout, engine.pool_address, engine.row_stride)
    reference.prepare(engine.last_job_table, FROM_POOL, None, JobHolds(), None)()
    assert same_bytes(storages, loaded) and not same_bytes(storages, poisoned)
    log.clear()
    engine.submit_store("s2", job)
    engine.submit_load("l2", job)
    assert not [entry for entry in log if entry[0] == "wait" and entry[2] is tables_ready[2]]
    # Later jobs upload their pair tables only.
    assert [entry[:2] for entry in log if entry[0] == "upload"] == [
        ("upload", "store"),
        ("upload", "load"),
    ]
    assert all(r.success for r in _finish(engine, log))
    assert not [entry for entry in log if entry[0] == "host sync"]


def test_jobs_run_at_submit_free_their_staging_when_the_copy_returned(
    stand_in: SimpleNamespace,
) -> None:
    """The CPU submit path (the host-cost benchmark runs the staged copier on it): a
    job's staging is free once its copy returned, so a long run reuses one buffer."""
    engine, triton = stand_in.engine, stand_in.triton
    engine.cuda = False
    engine.policy = FixedPath("triton")
    count = copiers.MAX_STAGING_BUFFERS + 6
    for job in range(count):
        assert engine.submit_store(job, JobSpec([[job % 12], [], []], [[4], [], []]))
    results = engine.get_finished()
    assert len(results) == count and all(r.success for r in results)
    assert len(triton.staging.buffers) == 1
