"""Fault injection through vLLM 0.33's real scheduler and ``TritonOffloadingConnector`` (CPU).

Each test injects one fault into a workload run by :class:`vllm_engine.Engine` (vLLM's core
``Scheduler``, this connector in both roles, a stand-in model whose KV is a function of
token and position, ``kv_load_failure_policy="recompute"``) and records a row: what
happened and how many loads failed, chunks were refused, requests recomputed, stores
failed, blocks were loaded corrupt and exceptions escaped. Asserted every time:

- no crash: no exception escapes vLLM's scheduler or the connector (a
  ``KeyboardInterrupt`` is the user's: it propagates, see its test);
- no corrupt load: every block of every request equals the cold run's (the model
  rewrites what it computes, so a difference is a block loaded wrong);
- nothing lost that was not corrupt: chunks that were fine still hit afterwards.

The last test prints the table and asserts 0 corrupt loads and 0 crashes over all
faults. The replicated-layout store (rank 0 killed) runs on two workers of one region
without the scheduler: vLLM's connector never submits a store on a non-writer rank.
The obj rows run vLLM's real obj tier against a moto S3 server (one per module, started
and stopped by PID) and load NIXL's CUDA-12 build into this process; they skip without
the tiers extra and fail instead where ``TRITON_OFFLOAD_REQUIRE_TIERS=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        make_offload_key,
    )

    import triton_offload.vllm as tv
    from tests.helpers.fault_workload import (
        BAD,
        CHUNKS,
        HOST_PAGE,
        SECOND,
        TOKENS,
        Row,
        first_computed_block,
        fs_file,
        fs_tier,
        host_row,
        keys_of,
        load_cuda12_nixl,
        make_engine,
        reseal_as_another_layout,
        serve,
        serve_rest,
        tiered_engine,
    )
    from tests.helpers.vllm_engine import BLOCK, PROMPT, Engine, prompt
    from tests.helpers.vllm_fixtures import offloading_config
    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec, host_manager
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

from tests.helpers.tier_peers import S3Server, require
from triton_offload.transfer import cpu_copy

TALLY: dict[str, Row] = {}


def record(fault: str) -> Row:
    row = Row(fault)
    TALLY[fault] = row
    return row


# ------------------------------------------------------------------ the workload


def tally(engine: Engine, row: Row) -> None:
    scheduler = engine.connector_scheduler
    row.failed_loads = scheduler.triton_failed_loads
    row.failed_stores = scheduler.triton_failed_stores
    row.refused_chunks = scheduler.triton_guard.chunks_refused
    row.recomputed = sum(engine.recomputed(req_id) for req_id in engine.computed)


def assert_all_chunks_hit(engine: Engine, row: Row, req_id: str, tokens: list[int]) -> None:
    """A fresh request of the same prompt loads every chunk: nothing fine was lost."""
    serve(engine, row, req_id, tokens)
    loaded = engine.hits.get(req_id, 0) // BLOCK
    row.kept = f"{loaded}/{CHUNKS}"
    assert loaded == CHUNKS
    assert engine.computed[req_id] == list(range(PROMPT, len(tokens)))


def restore_then_hit_all(engine: Engine, row: Row) -> None:
    """After a refused load: vLLM counted B's planned hits as stored, so B did not store
    the refused chunk again. C loads up to it, recomputes and stores it (lifting the
    quarantine); D then loads every chunk."""
    serve(engine, row, "C", SECOND)
    assert first_computed_block(engine, "C") == BAD
    assert not engine.connector_scheduler.triton_guard.quarantined
    assert_all_chunks_hit(engine, row, "D", SECOND)


def fail_copies(monkeypatch: pytest.MonkeyPatch, error: BaseException, after_bytes: int = 0) -> Any:
    """Make the CPU copy raise ``error``, after copying ``after_bytes`` of its first
    call (a copy that dies half-way leaves a torn row). Returns the undo."""
    real = cpu_copy._memmove
    calls = {"n": 0}

    def failing(dst: int, src: int, size: int) -> int:
        calls["n"] += 1
        if after_bytes:
            real(dst, src, min(size, after_bytes))
        raise error

    monkeypatch.setattr(cpu_copy, "_memmove", failing)

    def undo() -> int:
        monkeypatch.setattr(cpu_copy, "_memmove", real)
        return calls["n"]

    return undo


# ------------------------------------------------------------------ copy and driver faults


def test_a_copier_exception_on_a_load(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = record("copier exception (load)")
    engine = make_engine(engines, tmp_path)
    serve(engine, row, "A", TOKENS)
    undo = fail_copies(monkeypatch, RuntimeError("injected copy failure"))
    engine.add("B", SECOND)
    engine.step()  # lookup and load: the copy raises
    assert undo() >= 1
    serve_rest(engine, row, "B", SECOND)
    assert first_computed_block(engine, "B") == 0  # no block of the job counts as loaded
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.recomputed, row.failed_stores) == (1, 1, 0)
    row.outcome = "load failed; B recomputed from block 0"


def test_a_copier_exception_on_a_store(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = record("copier exception (store)")
    engine = make_engine(engines, tmp_path)
    undo = fail_copies(monkeypatch, RuntimeError("injected copy failure"))
    serve(engine, row, "A", TOKENS)  # its store's copy raises
    assert undo() >= 1
    engine.settle()
    # Nothing of it was published: B finds no chunk, computes all and stores them.
    serve(engine, row, "B", SECOND)
    assert engine.hits.get("B", 0) == 0 and first_computed_block(engine, "B") == 0
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.recomputed, row.failed_stores) == (0, 0, 1)
    row.outcome = "store failed, unpublished; keys stored again by B"


class _Event:
    """Stands in for torch.cuda.Event: complete as soon as it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _FailingStream:
    """A CUDA stream stand-in whose wait fails as a driver error would."""

    cuda_stream = 0

    def wait_event(self, event: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize(
    "where", ["CUDA stream (load)", "engine submit (load)", "engine submit (store)"]
)
def test_a_driver_error(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A driver error from the engine's CUDA path (stand-in streams and events, the job
    enqueued on a stream whose wait fails) or from the engine's submit itself."""
    row = record(f"driver error: {where}")
    engine = make_engine(engines, tmp_path)
    transfer = engine.transfer_worker.engine
    if where == "engine submit (store)":
        real_store = transfer.submit_store

        def broken_store(*args: Any, **kwargs: Any) -> bool:
            raise RuntimeError("CUDA driver error: device lost (stand-in)")

        monkeypatch.setattr(transfer, "submit_store", broken_store)
        serve(engine, row, "A", TOKENS)
        monkeypatch.setattr(transfer, "submit_store", real_store)
        engine.settle()
        serve(engine, row, "B", SECOND)
        assert engine.hits.get("B", 0) == 0
        assert_all_chunks_hit(engine, row, "C", SECOND)
        tally(engine, row)
        assert (row.failed_loads, row.failed_stores) == (0, 1)
        row.outcome = "store failed, unpublished; keys stored again by B"
        return
    serve(engine, row, "A", TOKENS)
    engine.add("B", SECOND)
    with monkeypatch.context() as patch:
        if where == "engine submit (load)":

            def broken_load(*args: Any, **kwargs: Any) -> bool:
                raise RuntimeError("CUDA driver error: device lost (stand-in)")

            patch.setattr(transfer, "submit_load", broken_load)
        else:
            patch.setattr(transfer, "cuda", True)
            patch.setattr(transfer, "_streams", {lane: _FailingStream() for lane in (0, 1, 2)})
            patch.setattr(torch.cuda, "Event", _Event)
            patch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
            patch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
            patch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        engine.step()  # lookup and load: the driver fails it (reported in this step)
    serve_rest(engine, row, "B", SECOND)
    assert first_computed_block(engine, "B") == 0
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.recomputed, row.failed_stores) == (1, 1, 0)
    row.outcome = "load failed; B recomputed from block 0"


def test_a_keyboard_interrupt_mid_load(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt is the user's: it propagates out of the connector's
    ``start_load_kv`` (vLLM's engine shuts down on it). The job was marked failed first:
    the next report names its blocks as load errors, so a caller that carries on (as
    this one does, finishing the step) recomputes them, and shutdown is clean."""
    row = record("KeyboardInterrupt mid-load")
    engine = make_engine(engines, tmp_path)
    serve(engine, row, "A", TOKENS)
    engine.add("B", SECOND)
    undo = fail_copies(monkeypatch, KeyboardInterrupt(), after_bytes=100)
    output = engine.scheduler.schedule()
    with pytest.raises(KeyboardInterrupt):
        engine.start(output)  # the load's copy is interrupted
    assert undo() == 1
    # The caller carries on: the rest of the step as Engine.step runs it.
    engine.finish(output)
    serve_rest(engine, row, "B", SECOND)
    assert first_computed_block(engine, "B") == 0
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.recomputed, row.failed_stores) == (1, 1, 0)
    row.outcome = "interrupt propagates; load reported failed, B recomputed"


def test_a_keyboard_interrupt_mid_store(
    engines: list[Engine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM submits a request's store at the start of the next step
    (``handle_preemptions``): the interrupt propagates from there and the store was
    marked failed first. A caller that carries on: vLLM's connector clears its list of
    deferred stores only after submitting all of them, so it submits the interrupted
    job again; the worker knows the job (its books were opened before the engine call)
    and does not start it twice: no error, one failed report. The store is never
    published, the next requests are served from a clean state."""
    row = record("KeyboardInterrupt mid-store")
    engine = make_engine(engines, tmp_path)
    undo = fail_copies(monkeypatch, KeyboardInterrupt(), after_bytes=100)
    request = engine.add("A", TOKENS)
    interrupted = 0
    for _ in range(40):
        output = engine.scheduler.schedule()
        try:
            engine.start(output)  # the store deferred from A's prefill is submitted here
        except KeyboardInterrupt:
            interrupted += 1
            undo()
            # The caller carries on with the step: the metadata bound, the loads started.
            engine.worker.bind_connector_metadata(output.kv_connector_metadata)
            engine.worker.start_load_kv(engine.context)
        engine.finish(output)
        if "A" in engine.finished and not engine.connector_scheduler._jobs:
            break
    assert interrupted == 1
    assert "could not be submitted" not in caplog.text  # the re-submission is no error
    del request
    engine.settle()
    serve(engine, row, "B", SECOND)
    assert engine.hits.get("B", 0) == 0
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.failed_stores) == (0, 1)
    row.outcome = "interrupt propagates; store failed, unpublished"


# ------------------------------------------------------------------ host memory faults


def test_a_byte_flipped_in_a_host_row(engines: list[Engine], tmp_path: Path) -> None:
    row = record("byte flipped in a host row")
    engine = make_engine(engines, tmp_path)
    serve(engine, row, "A", TOKENS)
    keys = keys_of(engine, TOKENS)
    engine.transfer_worker.engine.pool[host_row(engine, keys[BAD]), 5] ^= 0x40
    serve(engine, row, "B", SECOND)
    assert first_computed_block(engine, "B") == BAD  # the chunks before it loaded
    # Only the refused chunk was dropped: the fine ones after it are still stored.
    primary = host_manager(engine.offloading_manager)
    present = [primary.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT for k in keys]
    assert present == [index != BAD for index in range(CHUNKS)]
    restore_then_hit_all(engine, row)
    tally(engine, row)
    assert (row.failed_loads, row.refused_chunks, row.recomputed) == (1, 1, 1)
    assert row.failed_stores == 0
    row.outcome = f"load refused (seal); B recomputed from block {BAD}"


def test_a_worker_killed_mid_store(
    engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's copy dies half-way (a torn row in the host region): the store is
    never published, its keys are free, the torn row is never loaded."""
    row = record("worker killed mid-store")
    engine = make_engine(engines, tmp_path)
    undo = fail_copies(monkeypatch, RuntimeError("worker killed (stand-in)"), after_bytes=1000)
    serve(engine, row, "A", TOKENS)
    assert undo() >= 1
    engine.settle()
    serve(engine, row, "B", SECOND)
    assert engine.hits.get("B", 0) == 0
    assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    assert (row.failed_loads, row.failed_stores) == (0, 1)
    row.outcome = "torn store unpublished; keys stored again by B"


# ------------------------------------------------------------------ replicated layout


def replicated_worker(
    rank: int, engine_id: str, timeout_s: float, planes: list[torch.Tensor]
) -> Any:
    groups = (tv_group(),)
    config = offloading_config(
        groups=groups,
        worker_bytes=2 * 512,
        blocks_per_chunk=1,
        extra_config={
            "spec_name": "TritonOffloadingSpec",
            "cpu_bytes_to_use": 4 * HOST_PAGE,
            "backend": "torch",
            "replicated_store_timeout_s": timeout_s,
        },
        engine_id=engine_id,
        rank=rank,
        world_size=2,
        replicated=True,
    )
    spec = tv.TritonOffloadingSpec(config)
    # No barrier (no process group here): rank 0 creates the region and the ledger,
    # rank 1 maps the same files; they are unlinked when the creator shuts down.
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(p, 512) for p in planes],
        group_data_refs=[[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 512)]],
    )
    return spec.get_worker(caches)


def tv_group() -> Any:
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    return OffloadingGroupConfig(tokens_per_block=16, layer_names=("attn",), group_id=0)


def finished(worker: Any, job_id: int, timeout_s: float = 120.0) -> Any:
    """The worker's one result for ``job_id`` (polled; ``timeout_s`` only guards a hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            assert result.job_id == job_id
            return result
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} was never reported")


@pytest.mark.parametrize("death", ["copy dies", "rank 0 gone"])
def test_a_writer_killed_mid_store_under_the_replicated_layout(
    monkeypatch: pytest.MonkeyPatch, death: str
) -> None:
    """Rank 0 writes the one copy; rank 1 reports a store once the region's ledger says
    rank 0 finished it. Rank 0's copy dies: both report it failed at once. Rank 0 gone
    (never copies): rank 1 reports it failed after ``replicated_store_timeout_s``, not
    before and without hanging. Then a store that completes loads exactly on rank 1."""
    row = record(f"replicated store, {death}")
    # Rank 0 gone: rank 1 must wait out the bound (0.3 s, a lower bound a loaded machine
    # only lengthens). Copy dies: a bound no test run reaches, so a report can only come
    # from rank 0's published failure (waiting for the bound would hang, caught below).
    timeout_s = 0.3 if death == "rank 0 gone" else 3600.0
    engine_id = f"faults-{uuid.uuid4()}"
    generator = torch.Generator().manual_seed(4)
    planes = [
        [
            torch.randint(-128, 128, (8, 512), dtype=torch.int8, generator=generator)
            for _ in range(2)
        ]
        for _ in range(2)
    ]
    writer = replicated_worker(0, engine_id, timeout_s, planes[0])
    reader = replicated_worker(1, engine_id, timeout_s, planes[1])
    try:
        assert writer.writer and not reader.writer
        key = make_offload_key(b"replicated", 0)
        store = GPULoadStoreSpec([3], group_sizes=[1], block_indices=[0])
        host = KeyedCPULoadStoreSpec([1], [key])
        started = time.monotonic()
        assert reader.submit_store(5, store, host)
        if death == "copy dies":
            undo = fail_copies(
                monkeypatch, RuntimeError("worker killed (stand-in)"), after_bytes=64
            )
            assert writer.submit_store(5, store, host)
            undo()
            assert not finished(writer, 5).success
        result = finished(reader, 5)
        waited = time.monotonic() - started
        assert not result.success
        row.failed_stores = 1 + (death == "copy dies")
        if death == "rank 0 gone":
            assert waited >= timeout_s
        # The next store of the chunk completes and rank 1 loads rank 0's bytes.
        assert writer.submit_store(6, store, host) and reader.submit_store(6, store, host)
        assert finished(writer, 6).success and finished(reader, 6).success
        load = GPULoadStoreSpec([7], group_sizes=[1], block_indices=[0])
        assert reader.submit_load(9, KeyedCPULoadStoreSpec([1], [key]), load)
        assert finished(reader, 9).success
        for plane in range(2):
            assert torch.equal(planes[1][plane][7], planes[0][plane][3])
        row.kept = "1/1"
        row.outcome = (
            f"rank 1 failed it after {waited:.2f} s (bound {timeout_s} s)"
            if death == "rank 0 gone"
            else "both ranks failed it at once (ledger: failed)"
        )
    finally:
        reader.shutdown()
        writer.shutdown()


# ------------------------------------------------------------------ vLLM's fs tier


def offload_to_tier(engine: Engine, row: Row, stored: Callable[[Any], bool]) -> list[Any]:
    """A's chunks written to the secondary tier (``stored(key)`` says a chunk is there),
    then pushed out of the host tier by another request."""
    serve(engine, row, "A", TOKENS)
    engine.settle()
    keys = keys_of(engine, TOKENS)
    assert all(stored(key) for key in keys)
    other = prompt(extra=2 * BLOCK, seed=11)  # eight chunks: every host chunk
    serve(engine, row, "X", other)
    engine.settle()
    primary = host_manager(engine.offloading_manager)
    for key in keys:
        assert primary.lookup(key, ReqContext(req_id="probe")) is LookupResult.MISS
    return keys


FS_FAULTS = [
    "flipped byte",
    "truncated",
    "truncated after the page",
    "zero-length",
    "same-size garbage",
    "another key's file",
    "another layout's file",
]


@pytest.mark.parametrize("how", FS_FAULTS)
def test_a_bad_fs_chunk_file(engines: list[Engine], tmp_path: Path, how: str) -> None:
    row = record(f"fs tier: {how}")
    engine = tiered_engine(engines, tmp_path, fs_tier(tmp_path / "fs"))
    keys = offload_to_tier(engine, row, lambda key: fs_file(engine, key).exists())
    path = fs_file(engine, keys[BAD])
    data = path.read_bytes()
    if how == "flipped byte":
        changed = bytearray(data)
        changed[100] ^= 0x01
        path.write_bytes(bytes(changed))
    elif how == "truncated":
        # Cut inside the sealed page: the chunk's bytes and its seal are incomplete.
        path.write_bytes(data[: engine.connector_scheduler.triton_guard.page_bytes // 2])
    elif how == "truncated after the page":
        # Cut only the row's alignment padding: fs reports a short read, but the page
        # (chunk and seal) came through whole.
        path.write_bytes(data[: engine.connector_scheduler.triton_guard.page_bytes])
    elif how == "zero-length":
        path.write_bytes(b"")
    elif how == "same-size garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "another key's file":
        path.write_bytes(fs_file(engine, keys[BAD + 1]).read_bytes())
    else:
        page_bytes = engine.connector_scheduler.triton_guard.page_bytes
        path.write_bytes(reseal_as_another_layout(data, page_bytes))
    serve(engine, row, "B", SECOND)
    if how == "truncated after the page":
        # vLLM's fs tier fails the job on the short read and stops reading the files
        # after it; the seals show the cut chunk came through whole (kept and loaded)
        # and the rows it never wrote are not the chunks (refused until stored again).
        assert first_computed_block(engine, "B") == BAD + 1
        assert_all_chunks_hit(engine, row, "C", SECOND)
        tally(engine, row)
        assert (row.failed_loads, row.recomputed) == (0, 0)
        row.outcome = f"short read, page whole: chunk {BAD} kept by its seal"
        return
    # The chunks before the bad one were promoted and loaded; it and after recomputed.
    assert first_computed_block(engine, "B") == BAD
    # Refused at the worker's load (the scheduler checks headers only): a payload whose
    # checksum fails, a layout the scheduler cannot know.
    refused_at_load = how in ("flipped byte", "another layout's file")
    if refused_at_load:
        restore_then_hit_all(engine, row)
    else:
        # Refused before it counted: B stored it again, C loads every chunk.
        assert_all_chunks_hit(engine, row, "C", SECOND)
    tally(engine, row)
    guard = engine.connector_scheduler.triton_guard
    assert row.failed_stores == 0
    if how in ("truncated", "zero-length"):
        # vLLM's fs tier fails the whole promotion job on one short read and names no
        # key that was read: the seals tell which rows came through whole; the bad
        # chunk, and any row the tier left unwritten, are refused.
        assert row.refused_chunks >= 1
    else:
        assert row.refused_chunks == 1
    if refused_at_load:
        # The scheduler reads no payload byte and cannot know the worker's row layout:
        # the promotion passes and the worker's check refuses the load, its blocks
        # reported (then vLLM recomputes from it).
        assert (row.failed_loads, row.recomputed, guard.promotions_refused) == (1, 1, 0)
        why = "payload checksum" if how == "flipped byte" else "layout digest"
        row.outcome = f"promoted, load refused ({why}); recomputed from {BAD}"
    else:
        assert (row.failed_loads, row.recomputed) == (0, 0)
        where = "fs read failed" if how in ("truncated", "zero-length") else "seal"
        row.outcome = f"refused at promotion ({where}); hit ends at block {BAD}"


# ------------------------------------------------------------------ vLLM's obj tier


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One local S3 server (moto, 127.0.0.1) for the module's obj rows, stopped by PID."""
    require("obj")
    with S3Server.running() as server:
        yield server


@dataclasses.dataclass
class Promotion:
    """The bad chunk's promotion as the scheduler's seal check saw it."""

    tier_success: bool | None = None  # what the obj tier reported for it
    chunk: int = -1  # the host row it was read into
    row: bytes = b""  # that row as the tier left it


def watch_promotion(engine: Engine, key: Any, monkeypatch: pytest.MonkeyPatch) -> Promotion:
    """Record the tier's own verdict on ``key``'s promotion and the row it wrote, before
    the seal check decides."""
    guard = engine.connector_scheduler.triton_guard
    seen = Promotion()
    checked, problem = guard._checked_promotion, guard.promotion_problem
    wanted = bytes(key)

    def watched_checked(manager: Any, tier: Any, result: Any) -> Any:
        job = manager._jobs.get(result.job_id)
        if job is not None and wanted in {bytes(k) for k in job.transfer_job.keys}:
            read = {bytes(k) for k in result.successful_keys or ()}
            seen.tier_success = bool(result.success) or wanted in read
        return checked(manager, tier, result)

    def watched_problem(chunk: int, chunk_key: bytes) -> str | None:
        if bytes(chunk_key) == wanted:
            seen.chunk, seen.row = chunk, guard.region_rows[chunk].tobytes()
        return problem(chunk, chunk_key)

    monkeypatch.setattr(guard, "_checked_promotion", watched_checked)
    monkeypatch.setattr(guard, "promotion_problem", watched_problem)
    return seen


OBJ_FAULTS = ["garbage object", "half-size object", "object cut inside the page"]


@pytest.mark.parametrize("how", OBJ_FAULTS)
def test_a_bad_obj_chunk(
    engines: list[Engine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    how: str,
) -> None:
    """vLLM's obj tier through NIXL's OBJ plugin against a local S3 server: A's chunks
    cascade to it and leave the host tier, then chunk BAD's object is replaced (boto3)
    with same-size garbage, its first half, or the first half of its sealed page."""
    row = record(f"obj tier: {how}")
    row.outcome = "skipped"  # until the server runs (require() may skip or fail)
    server: S3Server = request.getfixturevalue("s3_server")
    row.outcome = ""
    load_cuda12_nixl()
    engine = tiered_engine(engines, tmp_path, server.tier(prefix=uuid.uuid4().hex))
    tier = engine.offloading_manager.secondary_tiers[0]
    s3 = server.client()

    def object_name(key: Any) -> str | None:
        with contextlib.suppress(LookupError):
            return server.object_name(tier._file_mapper.get_file_name(key))
        return None

    keys = offload_to_tier(engine, row, lambda key: object_name(key) is not None)
    name = object_name(keys[BAD])
    assert name is not None
    data = s3.get_object(Bucket=server.BUCKET, Key=name)["Body"].read()
    guard = engine.connector_scheduler.triton_guard
    row_bytes, page_bytes = guard.region_rows.shape[1], guard.page_bytes
    assert len(data) == row_bytes  # one object per host row, its alignment padding included
    if how == "garbage object":
        replaced = os.urandom(len(data))
    elif how == "half-size object":
        replaced = data[: len(data) // 2]
    else:
        replaced = data[: page_bytes // 2]
    s3.put_object(Bucket=server.BUCKET, Key=name, Body=replaced)
    before = guard.region_rows.copy()  # X's chunks: what the promotion overwrites
    seen = watch_promotion(engine, keys[BAD], monkeypatch)
    serve(engine, row, "B", SECOND)
    assert seen.chunk >= 0, "chunk BAD was not promoted from the obj tier"
    tally(engine, row)
    assert (row.failed_loads, row.recomputed, row.failed_stores) == (0, 0, 0)
    # What the obj tier reported for the read (NIXL's transfer state), and the sizes.
    read = f"obj read {'ok' if seen.tier_success else 'failed'}"
    size = f"{len(replaced)} of {row_bytes} B"
    if how == "half-size object":
        # The row is the 576-byte sealed page rounded up to 4096 bytes: the first half
        # holds the whole page, so the chunk is intact. The seal verifies it: a hit.
        assert len(replaced) >= page_bytes
        assert seen.row[:page_bytes] == data[:page_bytes]
        assert engine.hits["B"] == PROMPT and first_computed_block(engine, "B") == CHUNKS
        assert (row.refused_chunks, guard.promotions_refused) == (0, 0)
        assert_all_chunks_hit(engine, row, "C", SECOND)
        row.outcome = f"{read} ({size}); page whole: seal ok, loaded"
        return
    # Refused at promotion; the chunks before it loaded, it and after recomputed. Refused
    # before it counted: B stored it again, C loads every chunk.
    assert first_computed_block(engine, "B") == BAD
    assert row.refused_chunks == 1
    if how == "garbage object":
        # Bytes of the right size: only the seal can tell.
        assert seen.tier_success and guard.promotions_refused == 1
        row.outcome = f"{read}; refused at promotion (seal); hit ends at {BAD}"
    elif seen.tier_success:
        # NIXL's OBJ read of an object shorter than the row reports success: it wrote the
        # object's bytes and left the rest of the row as it was (X's chunk, seal and all).
        assert seen.row[: len(replaced)] == replaced
        assert seen.row[len(replaced) :] == before[seen.chunk, len(replaced) :].tobytes()
        assert guard.promotions_refused == 1
        row.outcome = f"{read} ({size}); rest stale; seal refused at {BAD}"
    else:
        row.outcome = f"{read} ({size}); refused; hit ends at {BAD}"
    assert_all_chunks_hit(engine, row, "C", SECOND)


# ------------------------------------------------------------------ the summary

COLUMNS = [
    ("fault", 40),
    ("outcome", 58),
    ("failed loads", 6),
    ("refused", 7),
    ("recomputed", 10),
    ("failed stores", 6),
    ("corrupt", 7),
    ("crashes", 7),
    ("kept", 4),
]


def table(rows: list[Row]) -> str:
    fields = [f.name for f in dataclasses.fields(Row)]
    widths = [max(width, len(name)) for name, width in COLUMNS]
    lines = [" | ".join(name.ljust(w) for (name, _), w in zip(COLUMNS, widths, strict=True))]
    for row in rows:
        values = [str(getattr(row, name)) for name in fields]
        lines.append(" | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)))
    return "\n".join(lines)


def test_no_fault_loaded_a_corrupt_block_or_crashed(capsys: pytest.CaptureFixture[str]) -> None:
    rows = list(TALLY.values())
    if not rows:
        pytest.skip("no fault ran in this session")
    ran = [row for row in rows if row.outcome != "skipped"]
    corrupt = sum(row.corrupt_loads for row in rows)
    crashes = sum(row.crashes for row in rows)
    with capsys.disabled():
        print(f"\n\nfault injection: {len(ran)} faults run, {len(rows) - len(ran)} skipped")
        print(table(rows))
        print(f"total: {corrupt} corrupt loads, {crashes} crashes\n")
    assert all(row.outcome for row in rows), [row.fault for row in rows if not row.outcome]
    assert corrupt == 0 and crashes == 0
