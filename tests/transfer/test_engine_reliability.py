"""TransferEngine under bad arguments, faults, threads and changed caches.

Each behaviour here used to end silently wrong, crash or hang: a refusal must name
the bad value before any byte moves, a failed job must be reported failed (once),
and nothing may write after its failure was reported.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer import cpu_copy
from triton_offload.transfer.engine import TransferEngine

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
]
NUM_BLOCKS = 6
ROWS = 4


def plan(num_groups: int = 1, blocks_per_chunk: int = 1) -> Any:
    groups = [GroupSpec("full_attention", 16) for _ in range(num_groups)]
    return plan_offload(groups, blocks_per_chunk=blocks_per_chunk)


def random_tensor(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


# ------------------------------------------------------------------ constructor arguments


@pytest.mark.parametrize(
    ("num_programs", "error", "match"),
    [
        ("4", TypeError, r"num_programs must be an int, got '4'"),
        (2.0, TypeError, r"num_programs must be an int, got 2.0"),
        (True, TypeError, r"num_programs must be an int, got True"),
        (0, ValueError, r"num_programs 0 must be >= 1"),
        (-3, ValueError, r"num_programs -3 must be >= 1"),
        # Beyond CUDA's grid x limit: accepted, then every job failed at launch.
        (2**31, ValueError, r"num_programs 2147483648 must be at most 65536"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_num_programs_is_checked_at_construction(
    backend: str, num_programs: object, error: type, match: str
) -> None:
    # 0 or -3 used to launch an empty grid: every job reported success, nothing copied.
    if backend == "triton" and not INTERPRETED:
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    with pytest.raises(error, match=match):
        TransferEngine(
            plan(),
            [[random_tensor(NUM_BLOCKS, 32)]],
            ROWS,
            backend=backend,
            num_programs=num_programs,  # type: ignore[arg-type]
        )


def test_num_host_blocks_beyond_host_memory_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"num_host_blocks 10{15} x 32 bytes per row"):
        TransferEngine(plan(), [[random_tensor(NUM_BLOCKS, 32)]], 10**15, backend="torch")


@pytest.mark.parametrize("bad_plan", ["plan", None, object()])
def test_plan_must_be_an_offload_plan(bad_plan: object) -> None:
    with pytest.raises(TypeError, match=r"plan must be an OffloadPlan"):
        TransferEngine(bad_plan, [[random_tensor(NUM_BLOCKS, 32)]], ROWS)  # type: ignore[arg-type]


def test_pool_on_the_meta_device_is_refused() -> None:
    cache = random_tensor(NUM_BLOCKS, 32)
    pool = torch.empty(ROWS, 32, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"pool is on meta"):
        TransferEngine(plan(), [[cache]], ROWS, backend="torch", pool=pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bool])
def test_pool_of_another_dtype_is_refused(dtype: torch.dtype) -> None:
    cache = random_tensor(NUM_BLOCKS, 32)
    pool = torch.zeros(ROWS, 32, dtype=dtype)
    with pytest.raises(ValueError, match=rf"pool must be a uint8 tensor.*{dtype}"):
        TransferEngine(plan(), [[cache]], ROWS, backend="torch", pool=pool)


def test_pool_overlapping_a_cache_plane_is_refused() -> None:
    # The pool as a view of the same memory as a cache: a store would write the cache.
    memory = random_tensor(NUM_BLOCKS + ROWS, 32)
    cache, pool = memory[:NUM_BLOCKS], memory[NUM_BLOCKS - 1 : NUM_BLOCKS - 1 + ROWS]
    with pytest.raises(ValueError, match=r"pool .* overlaps group 0 layer 0 plane 0"):
        TransferEngine(plan(), [[cache]], ROWS, backend="torch", pool=pool)
    # A pool right after the cache, sharing no byte, is fine.
    pool = memory[NUM_BLOCKS:]
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="torch", pool=pool)
    engine.shutdown()


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_one_off_copy_refuses_a_pool_inside_a_cache() -> None:
    from triton_offload.transfer.copiers import copy_blocks
    from triton_offload.transfer.layout import build_layout

    memory = random_tensor(NUM_BLOCKS + ROWS, 32)
    layout = build_layout([[memory[:NUM_BLOCKS]]], num_groups=1, blocks_per_chunk=1)
    before = memory.clone()
    with pytest.raises(ValueError, match=r"pool .* overlaps group 0 layer 0 plane 0"):
        copy_blocks(layout, [[0, 0, 0]], [0, 1], memory[NUM_BLOCKS - 2 :], 0)
    assert torch.equal(memory, before)
    copy_blocks(layout, [[1, 0, 0]], [0, 1], memory[NUM_BLOCKS:], 0)
    assert torch.equal(memory[NUM_BLOCKS], memory[1])


# ------------------------------------------------------------------ small items


def test_zero_block_tensor_names_the_plane() -> None:
    with pytest.raises(ValueError, match=r"group 0 layer 0 plane 1 has 0 blocks"):
        TransferEngine(
            plan(),
            [[(random_tensor(NUM_BLOCKS, 8), random_tensor(0, 8))]],
            ROWS,
            backend="torch",
        )
    with pytest.raises(ValueError, match=r"group 0 layer 0 plane 0 has 0 blocks"):
        TransferEngine(plan(), [[random_tensor(0, 8)]], ROWS, backend="torch")


@pytest.mark.parametrize(
    ("gpu", "host", "match"),
    [
        ([[True, 2]], [[0, 1]], r"gpu_blocks\[0\] must hold integer ids, got bool"),
        ([[0, 1]], [[True, 2]], r"host_blocks\[0\] must hold integer ids, got bool"),
        ([[np.True_, 2]], [[0, 1]], r"gpu_blocks\[0\] must hold integer ids, got bool"),
    ],
)
def test_bool_ids_are_refused(gpu: list, host: list, match: str) -> None:
    # np.asarray([True, 7]) is an int array [1, 7]: True used to name block 1.
    engine = TransferEngine(plan(), [[random_tensor(NUM_BLOCKS, 8)]], ROWS, backend="torch")
    before = engine.pool.clone()
    with pytest.raises(TypeError, match=match):
        engine.submit_store(0, gpu_blocks=gpu, host_blocks=host)
    assert torch.equal(engine.pool, before)
    assert engine.get_finished() == []


# ------------------------------------------------------------------ failure semantics


def _interrupt_on_call(
    monkeypatch: pytest.MonkeyPatch, when: int, error: BaseException
) -> dict[str, int]:
    calls = {"n": 0}
    real = cpu_copy._memmove

    def memmove(dst: int, src: int, size: int) -> int:
        calls["n"] += 1
        if calls["n"] == when:
            raise error
        return real(dst, src, size)

    monkeypatch.setattr(cpu_copy, "_memmove", memmove)
    return calls


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), SystemExit(3), RuntimeError("injected")], ids=repr
)
def test_a_job_interrupted_by_any_exception_is_reported_failed(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    cache = random_tensor(NUM_BLOCKS, 64)
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="torch")
    calls = _interrupt_on_call(monkeypatch, 2, error)
    # Blocks 0, 2, 4 are not adjacent: three copies, the second one raises.
    if isinstance(error, Exception):
        assert engine.submit_store("cut", gpu_blocks=[[0, 2, 4]], host_blocks=[[0, 1, 2]])
    else:
        with pytest.raises(type(error)):
            engine.submit_store("cut", gpu_blocks=[[0, 2, 4]], host_blocks=[[0, 1, 2]])
    assert calls["n"] == 2
    monkeypatch.undo()
    results = engine.get_finished()
    assert [(r.job_id, r.success) for r in results] == [("cut", False)]
    assert engine.get_finished() == []
    # The engine still works, the id included.
    assert engine.submit_store("cut", gpu_blocks=[[1]], host_blocks=[[3]])
    (result,) = engine.get_finished()
    assert result.success and torch.equal(engine.pool[3], cache[1])


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_a_kernel_job_interrupted_by_keyboard_interrupt_is_reported_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from triton_offload.kernels import copy_blocks

    cache = random_tensor(NUM_BLOCKS, 64)
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="triton")
    real = copy_blocks.launch_copy

    def launch_then_interrupt(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(copy_blocks, "launch_copy", launch_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.submit_load("cut", host_blocks=[[0, 1]], gpu_blocks=[[3, 4]])
    monkeypatch.undo()
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [("cut", False)]
    assert engine.get_finished() == []


def test_a_failed_multithreaded_copy_stopped_writing_before_it_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The calling thread's share raises while helper threads still copy: the job must
    not be reported (nor a later job run) before the helpers are done, or a later
    store into the same rows is overwritten by the failed job's late writes."""
    page = 64 << 10
    cache = random_tensor(8, page)
    engine = TransferEngine(plan(), [[cache]], 8, backend="torch")
    monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", 0)  # four pages: threaded all the same
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: 2)
    main = threading.get_ident()
    real = cpu_copy._memmove
    helper_done: list[float] = []
    helper_started = threading.Event()

    def memmove(dst: int, src: int, size: int) -> int:
        if threading.get_ident() == main:
            # Fail only once the helper is inside its share (not merely queued).
            assert helper_started.wait(10)
            raise RuntimeError("injected failure on the calling thread")
        helper_started.set()
        time.sleep(0.2)  # a helper still copying when the caller's share failed
        result = real(dst, src, size)
        helper_done.append(time.monotonic())
        return result

    monkeypatch.setattr(cpu_copy, "_memmove", memmove)
    # Blocks 0, 2, 4, 6 -> rows 7, 5, 3, 1: four separate runs, two per thread.
    engine.submit_store("bad", gpu_blocks=[[0, 2, 4, 6]], host_blocks=[[7, 5, 3, 1]])
    (result,) = engine.get_finished()
    reported = time.monotonic()
    monkeypatch.undo()
    assert not result.success
    assert len(helper_done) == 2 and max(helper_done) <= reported
    # A later store into the same rows keeps its bytes.
    engine.submit_store("good", gpu_blocks=[[1, 3, 5, 7]], host_blocks=[[7, 5, 3, 1]])
    (result,) = engine.get_finished()
    assert result.success
    time.sleep(0.3)
    for block, row in zip([1, 3, 5, 7], [7, 5, 3, 1], strict=True):
        assert torch.equal(engine.pool[row], cache[block]), row


# ------------------------------------------------------------------ cache lifetime


@pytest.mark.parametrize("change", ["resize_", "set_", "storage_resize"])
def test_a_reallocated_cache_is_refused_naming_the_plane(change: str) -> None:
    keep = random_tensor(NUM_BLOCKS, 32, seed=1)
    cache = random_tensor(NUM_BLOCKS, 32, seed=2)
    engine = TransferEngine(plan(), [[keep, cache]], ROWS, backend="torch")
    engine.pool.fill_(7)
    if change == "resize_":
        cache.resize_(NUM_BLOCKS * 1000, 32)  # a new, larger allocation
    elif change == "set_":
        cache.set_(random_tensor(NUM_BLOCKS, 32, seed=3).untyped_storage())
    else:
        cache.untyped_storage().resize_(0)  # the memory is freed
    with pytest.raises(ValueError, match=r"group 0 layer 1 plane 0 .*(reallocated|resized)"):
        engine.submit_store(0, gpu_blocks=[[0]], host_blocks=[[0]])
    with pytest.raises(ValueError, match=r"group 0 layer 1 plane 0"):
        engine.submit_load(1, host_blocks=[[0]], gpu_blocks=[[0]])
    assert torch.equal(engine.pool, torch.full_like(engine.pool, 7))
    assert engine.get_finished() == []


# ------------------------------------------------------------------ aliasing by bytes


def test_two_planes_of_one_group_over_the_same_bytes_are_refused() -> None:
    cache = random_tensor(NUM_BLOCKS, 32)
    with pytest.raises(
        ValueError, match=r"group 0 layer 1 plane 0\) overlaps plane 0 \(group 0 layer 0 plane 0\)"
    ):
        TransferEngine(plan(), [[cache, cache]], ROWS, backend="torch")
    with pytest.raises(ValueError, match=r"overlaps"):
        TransferEngine(plan(), [[cache, cache[:, 16:]]], ROWS, backend="torch")
    memory = random_tensor(NUM_BLOCKS + 1, 32)
    with pytest.raises(ValueError, match=r"group 0 layer 1 plane 0\) overlaps"):
        TransferEngine(plan(), [[memory[:NUM_BLOCKS], memory[1:]]], ROWS, backend="torch")


def _load_pool(engine: TransferEngine, seed: int) -> None:
    engine.pool.copy_(random_tensor(*engine.pool.shape, seed=seed))


def test_shifted_views_in_two_groups_are_checked_by_bytes() -> None:
    # Group 0 sees x, group 1 sees x[1:]: block b + 1 of group 0 is block b of group 1.
    memory = random_tensor(NUM_BLOCKS + 1, 32)
    engine = TransferEngine(plan(2), [[memory[:NUM_BLOCKS]], [memory[1:]]], ROWS, backend="torch")
    _load_pool(engine, 5)
    before = memory.clone()
    with pytest.raises(ValueError, match=r"group 0 .* group 1 .* same bytes|both write"):
        engine.submit_load(0, host_blocks=[[0], [1]], gpu_blocks=[[3], [2]])
    assert torch.equal(memory, before)
    # Different blocks of the same memory are fine, and land where expected.
    assert engine.submit_load(1, host_blocks=[[0], [1]], gpu_blocks=[[3], [3]])
    (result,) = engine.get_finished()
    assert result.success
    assert torch.equal(memory[3], engine.pool[0])
    assert torch.equal(memory[4], engine.pool[1])


def test_different_block_sizes_over_the_same_memory_are_checked_by_bytes() -> None:
    # Group 0: 64-byte blocks; group 1: 32-byte blocks of the same bytes.
    memory = random_tensor(NUM_BLOCKS, 64)
    small = memory.view(2 * NUM_BLOCKS, 32)
    engine = TransferEngine(plan(2), [[memory], [small]], ROWS, backend="torch")
    _load_pool(engine, 6)
    before = memory.clone()
    # Group 0 block 1 covers group 1 blocks 2 and 3.
    with pytest.raises(ValueError, match=r"group 0 .* group 1 .* same bytes|both write"):
        engine.submit_load(0, host_blocks=[[0], [1]], gpu_blocks=[[1], [3]])
    assert torch.equal(memory, before)
    assert engine.submit_load(1, host_blocks=[[0], [1]], gpu_blocks=[[1], [4]])
    (result,) = engine.get_finished()
    assert result.success
    assert torch.equal(memory[1], engine.pool[0, :64])
    assert torch.equal(small[4], engine.pool[1, :32])


# ------------------------------------------------------------------ empty groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_with_no_layers_is_valid_and_moves_nothing(backend: str) -> None:
    # A pipeline stage that holds none of group 1's layers still gets its block ids.
    cache = random_tensor(NUM_BLOCKS, 48)
    engine = TransferEngine(plan(2), [[cache], []], ROWS, backend=backend)
    engine.pool.fill_(9)
    assert engine.submit_store(0, gpu_blocks=[[2], [0, 1, 5]], host_blocks=[[1], [3, 0, 2]])
    (result,) = engine.get_finished()
    assert result.success and result.transfer_size == 48
    expected = torch.full_like(engine.pool, 9)
    expected[1, :48] = cache[2]
    assert torch.equal(engine.pool, expected)
    assert engine.submit_load(1, host_blocks=[[1], [2]], gpu_blocks=[[4], [7]])
    (result,) = engine.get_finished()
    assert result.success and result.transfer_size == 48
    assert torch.equal(cache[4], cache[2])


# ------------------------------------------------------------------ threads

THREAD_SECONDS = float(os.environ.get("TRITON_OFFLOAD_THREAD_SECONDS", "2"))


@pytest.mark.parametrize("backend", ["torch"])
def test_submitter_and_poller_threads_lose_nothing(backend: str) -> None:
    """One thread submits stores (and waits on some), another polls get_finished: every
    accepted job is reported exactly once, and only after its bytes are in the pool.

    Each job writes a block carrying its own tag into a row; the row is reused only
    after the poller checked the earlier job, so a report that came before the copy
    (or a lost or repeated report) is seen as a wrong tag, a missing id or a repeat.
    """
    page = 16 << 10
    blocks, rows = 8, 8
    cache = torch.zeros(blocks, page, dtype=torch.uint8)
    engine = TransferEngine(plan(), [[cache]], rows, backend=backend)
    row_free = [threading.Semaphore(1) for _ in range(rows)]
    tags: dict[int, int] = {}  # job id -> tag written for it
    reported: list[int] = []
    problems: list[str] = []
    stop = threading.Event()
    submitted_all = threading.Event()
    submitted: list[int] = []

    def tag_block(job: int) -> None:
        # A tag that differs between any two jobs sharing a block: first 8 bytes = id.
        cache[job % blocks, :8] = torch.tensor(list(job.to_bytes(8, "little")), dtype=torch.uint8)
        cache[job % blocks, 8:] = job % 251

    def submitter() -> None:
        job = 0
        deadline = time.monotonic() + THREAD_SECONDS
        try:
            while time.monotonic() < deadline and not stop.is_set():
                row = job % rows
                if not row_free[row].acquire(timeout=60):  # a hang guard only
                    problems.append(f"row {row} never released: job {job - rows} lost")
                    return
                tag_block(job)
                tags[job] = job
                assert engine.submit_store(job, gpu_blocks=[[job % blocks]], host_blocks=[[row]])
                submitted.append(job)
                if job % 7 == 0:
                    try:
                        engine.wait([job])
                    except ValueError as error:  # the poller may have reported it already
                        if "already reported" not in str(error):
                            raise
                job += 1
        except BaseException as error:
            problems.append(f"submitter: {error!r}")
        finally:
            submitted_all.set()

    def poller() -> None:
        seen: set[int] = set()
        try:
            while not stop.is_set():
                results = engine.get_finished()
                for result in results:
                    job = int(result.job_id)
                    if job in seen:
                        problems.append(f"job {job} reported twice")
                    seen.add(job)
                    reported.append(job)
                    if not result.success:
                        problems.append(f"job {job} failed")
                    row = job % rows
                    landed = engine.pool[row, :8].tolist()
                    if (
                        landed != list(job.to_bytes(8, "little"))
                        or int(engine.pool[row, -1]) != job % 251
                    ):
                        problems.append(f"job {job} reported before its bytes landed")
                    row_free[row].release()
                if not results and submitted_all.is_set() and len(seen) >= len(submitted):
                    return
        except BaseException as error:
            problems.append(f"poller: {error!r}")

    threads = [threading.Thread(target=submitter), threading.Thread(target=poller)]
    for thread in threads:
        thread.start()
    submitted_all.wait(THREAD_SECONDS + 30)
    threads[1].join(timeout=30)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert not problems, problems[:5]
    assert sorted(reported) == submitted
    assert len(submitted) > 10


def test_wait_and_poll_from_other_threads_during_a_cpu_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While one thread's copy runs: get_finished from another thread returns at once
    and does not report the job; wait blocks until the copy returned."""
    cache = random_tensor(NUM_BLOCKS, 64)
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="torch")
    entered, release = threading.Event(), threading.Event()
    real = cpu_copy._memmove

    def held(dst: int, src: int, size: int) -> int:
        entered.set()
        release.wait(10)
        return real(dst, src, size)

    monkeypatch.setattr(cpu_copy, "_memmove", held)
    submitter = threading.Thread(
        target=engine.submit_store, args=("j",), kwargs={"gpu_blocks": [[2]], "host_blocks": [[1]]}
    )
    submitter.start()
    assert entered.wait(10)
    returned = threading.Event()

    def waiter() -> None:
        engine.wait(["j"])
        returned.set()

    waiting = threading.Thread(target=waiter)
    waiting.start()
    assert engine.get_finished() == []  # the copy has not returned
    assert not returned.wait(0.2)
    release.set()
    for thread in (submitter, waiting):
        thread.join(10)
    assert returned.is_set()
    (result,) = engine.get_finished()
    assert result.job_id == "j" and result.success
    assert torch.equal(engine.pool[1], cache[2])


class _Event:
    """Stands in for torch.cuda.Event: complete as soon as it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        assert self.recorded

    def elapsed_time(self, other: Any) -> float:
        return 1.0


class _Stream:
    cuda_stream = 0

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_cuda_path_reports_an_interrupted_job_failed_with_stand_ins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA submit path without a GPU (stand-in streams and events, the CPU copier
    doing the work): a KeyboardInterrupt while enqueueing still records the job's end,
    marks it failed and reports it once; then it propagates."""
    import contextlib

    cache = random_tensor(NUM_BLOCKS, 64)
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="torch")
    engine.cuda = True
    engine._streams = {0: _Stream(), 1: _Stream()}
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    _interrupt_on_call(monkeypatch, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.submit_store("cut", gpu_blocks=[[0, 2]], host_blocks=[[0, 1]])
    engine.wait(["cut"])  # its end was recorded: wait returns
    assert [(r.job_id, r.success) for r in engine.get_finished()] == [("cut", False)]
    assert engine.get_finished() == []


@pytest.mark.parametrize("interrupt_at", [1, 2, 3])
def test_an_interrupt_inside_get_finished_loses_no_result(
    monkeypatch: pytest.MonkeyPatch, interrupt_at: int
) -> None:
    """A KeyboardInterrupt while get_finished turns finished jobs into results (after it
    took them off its queues) loses none: the next call reports every one, once."""
    from triton_offload.transfer import engine as engine_module

    cache = random_tensor(NUM_BLOCKS, 64)
    engine = TransferEngine(plan(), [[cache]], ROWS, backend="torch")
    for job in range(3):
        assert engine.submit_store(job, gpu_blocks=[[job]], host_blocks=[[job]])
    original = engine_module.RunningJob.result
    calls = {"n": 0}

    def interrupted(self: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == interrupt_at:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(engine_module.RunningJob, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.get_finished()
    monkeypatch.undo()
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2]
    assert all(r.success for r in results)
    assert engine.get_finished() == []
    engine.wait([])  # nothing in flight, nothing pending
