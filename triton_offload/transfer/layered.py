"""Layer-staged loads: one step's loads copied stage by stage, an event after each stage.

A load that feeds the same step's forward pass (vLLM's sync loads) would otherwise hold
the forward until the whole job landed. Here the caller names *stages*: disjoint sets
of the layout's planes that together cover every plane (typically: every plane that no
per-layer hook waits for, such as Mamba state, then one stage per attention layer in
forward order). All jobs of the step are enqueued stage by stage (stage ``k`` of every
job before stage ``k + 1`` of any), each stage is one launch (or one batched DMA call)
per job and plane subset, and an event follows each stage. The forward then waits for
a layer's stage only (:meth:`LayeredLoad.wait`): on CUDA a stream wait, never a host
block; on the CPU path, where the copies run on a thread, a bounded host wait.

Each job is validated once, before any byte moves, and reported once by the engine's
``get_finished`` (one ``TransferResult`` per job, FIFO in the expedited lane), with its
page checksums when asked: the sums of every stage add up to the page's (the passes over
the slots and bytes a job does not move run after the last stage). A stage that fails
fails every job of the submission exactly once and releases every remaining wait; so
does a CPU copy thread that takes the lane's copy lock only after ``shutdown`` released
the pool (it copies nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from triton_offload.transfer.checksums import host_checksums, job_pages
from triton_offload.transfer.copiers import PageSums
from triton_offload.transfer.job_state import EXPEDITED_LOAD, RunningJob
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL, JobSpec, PairTable

if TYPE_CHECKING:
    from triton_offload.transfer.engine import TransferEngine

logger = logging.getLogger(__name__)

#: Seconds a CPU-path wait for one stage may take before the load is given up (a stage
#: that never ends must not hang the forward; the jobs are then reported failed).
STAGE_WAIT_SECONDS = 60.0


@dataclass
class LayeredLoad:
    """What :meth:`TransferEngine.submit_layered_loads` returns: one event per stage.

    ``wait(k)`` orders what follows after stage ``k`` (CUDA: the current stream waits
    for its event; CPU: the calling thread waits for it, at most ``timeout_s``).
    ``waited`` records the stages waited for, ``failed`` whether a stage failed or a
    wait timed out (the engine then reports every job of the submission failed).
    """

    job_ids: tuple[Hashable, ...]
    num_stages: int
    cuda: bool
    device: torch.device
    events: list[Any] = field(default_factory=list)
    waited: set[int] = field(default_factory=set)
    failed: bool = False
    timeout_s: float = STAGE_WAIT_SECONDS
    _jobs: list[Any] = field(default_factory=list, repr=False)
    #: CPU: set once every job of the submission was handed to the engine's books.
    _ended: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, stage: int) -> bool:
        """Make what follows wait for stage ``stage``; False when the stage failed or (CPU)
        did not end within ``timeout_s`` (the jobs are then failed, never hung)."""
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise TypeError(f"stage must be an int, got {stage!r}")
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range [0, {self.num_stages})")
        self.waited.add(stage)
        event = self.events[stage]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(event)
            return not self.failed
        if not event.wait(self.timeout_s):
            logger.error(
                "layer-staged load %s: stage %d did not end within %.0f s; its jobs are "
                "reported failed",
                list(self.job_ids),
                stage,
                self.timeout_s,
            )
            self.fail_all()
            return False
        return not self.failed

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait on the host until every stage ended; False if one failed or timed out."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        if self.cuda:
            for job in self._jobs:
                job.end.synchronize()  # the last stage, the checksum passes, the sums
        elif not self._ended.wait(limit):
            self.fail_all()
            return False
        return not self.failed

    def fail_all(self) -> None:
        """Every job of the submission fails; every remaining wait is released."""
        self.failed = True
        for job in self._jobs:
            job.success = False
        if not self.cuda:
            for event in self.events:
                event.set()


def check_stages(stages: object, num_planes: int) -> list[tuple[int, ...]]:
    """``stages`` as sorted tuples: disjoint plane indices covering every plane."""
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(f"stages must be a non-empty sequence of plane index lists, got {stages!r}")
    seen: dict[int, int] = {}
    checked: list[tuple[int, ...]] = []
    for number, stage in enumerate(stages):
        if isinstance(stage, (str, bytes)) or not isinstance(stage, Sequence):
            raise TypeError(f"stage {number} must be a sequence of plane indices, got {stage!r}")
        for plane in stage:
            if isinstance(plane, bool) or not isinstance(plane, int):
                raise TypeError(f"stage {number}: plane index {plane!r} is not an int")
            if not 0 <= plane < num_planes:
                raise ValueError(f"stage {number}: plane {plane} out of range [0, {num_planes})")
            if plane in seen:
                raise ValueError(f"plane {plane} is in stage {seen[plane]} and stage {number}")
            seen[plane] = number
        checked.append(tuple(sorted(stage)))
    missing = sorted(set(range(num_planes)) - set(seen))
    if missing:
        raise ValueError(f"planes {missing} are in no stage: every plane must be loaded")
    return checked


def _stage_assignment(assignment: Any, stage: tuple[int, ...], num_planes: int) -> Any:
    """The job's (copier, planes) restricted to one stage's planes (empty parts dropped)."""
    wanted = set(stage)
    parts = []
    for name, planes in assignment:
        chosen = tuple(p for p in (range(num_planes) if planes is None else planes) if p in wanted)
        if chosen:
            parts.append((name, None if len(chosen) == num_planes else chosen))
    return tuple(parts)


def _job_runs(
    engine: TransferEngine,
    job: RunningJob,
    table: PairTable,
    stages: list[tuple[int, ...]],
    stream: Any,
) -> tuple[list[list[Callable[[], None]]], list[Callable[[], None]]]:
    """(runs of each stage, runs after the last stage) of one job."""
    num_planes = len(engine.layout.planes)
    holds = job.holds
    summer = engine._summer if job.checksum else None
    page_sums = None
    pages = None
    if summer is not None:
        pages = job_pages(engine.layout, table)
        page_sums = torch.zeros(pages.rows.size, dtype=torch.int64, device=engine.device)
        holds.keep_alive.append(page_sums)
    per_stage: list[list[Callable[[], None]]] = []
    for stage in stages:
        parts = _stage_assignment(job.assignment, stage, num_planes)
        subset = None if len(stage) == num_planes else stage
        if summer is not None and pages is not None and page_sums is not None:
            if parts == (("triton", subset),):
                sums = PageSums(page_sums, pages.pair_pages)
                runs = [summer.prepare(table, FROM_POOL, subset, holds, stream, sums=sums)]
            else:
                runs = [
                    engine.copiers[name].prepare(table, FROM_POOL, planes, holds, stream)
                    for name, planes in parts
                ]
                landed = PageSums(page_sums, pages.pair_pages, write=False)
                runs.append(summer.prepare(table, TO_POOL, subset, holds, stream, sums=landed))
        else:
            runs = [
                engine.copiers[name].prepare(table, FROM_POOL, planes, holds, stream)
                for name, planes in parts
            ]
        per_stage.append(runs)
    tail: list[Callable[[], None]] = []
    if summer is not None and pages is not None and page_sums is not None:
        tail = engine._summed_tail(job, pages, page_sums, stream)
    elif job.checksum:
        # The CPU path: the host hashes each page once the last stage landed.
        def hash_pages() -> None:
            sums = host_checksums(
                engine.pool.numpy(), engine.layout, table, engine.checksum_algorithm
            )
            job.checksum_rows, job.checksum_values = sums.rows, sums.values

        tail.append(hash_pages)
    return per_stage, tail


def submit_layered(
    engine: TransferEngine,
    jobs: Sequence[tuple[Hashable, JobSpec]],
    stages: Sequence[Sequence[int]],
    *,
    checksum: bool,
) -> LayeredLoad:
    """Validate every job, then enqueue (CUDA) or start (CPU, on a thread) them stage by
    stage; see the module docstring. The engine's lock is held by the caller."""
    checked = check_stages(stages, len(engine.layout.planes))
    made: list[tuple[RunningJob, PairTable]] = []
    for job_id, spec in jobs:
        table = engine.build_job_table(spec, FROM_POOL)
        counts = [blocks.size for blocks in spec.gpu_blocks]
        size = sum(c * b for c, b in zip(counts, engine._bytes_per_block, strict=True))
        job = RunningJob(
            job_id, FROM_POOL, engine.policy.assign(FROM_POOL, counts), size, EXPEDITED_LOAD
        )
        job.checksum = checksum
        job.checksum_algorithm = engine.checksum_algorithm
        made.append((job, table))
    handle = LayeredLoad(
        tuple(job.job_id for job, _ in made), len(checked), engine.cuda, engine.device
    )
    handle._jobs = [job for job, _ in made]
    if not engine.cuda:
        handle.events = [threading.Event() for _ in checked]
    # From the first job entering the books, an interrupt (KeyboardInterrupt, SystemExit)
    # at any line must still leave every job reported once: the jobs not yet marked
    # finished are failed, queued and marked here, and every wait is released. On CPU
    # the copy thread marks them itself under the same lock and skips jobs settled
    # first, so a thread that did start never reports one twice.
    try:
        for job, _ in made:
            engine._active[job.job_id] = job
        if engine.cuda:
            _enqueue_cuda(engine, made, checked, handle)
        else:
            thread = threading.Thread(
                target=_run_cpu,
                args=(engine, made, checked, handle),
                name="triton-offload-layered-load",
                daemon=True,
            )
            thread.start()
    except BaseException:
        handle.fail_all()
        for job, _ in made:
            engine._settle_interrupted(job)
        if not engine.cuda:
            for event in handle.events:
                event.set()
            handle._ended.set()
        raise
    return handle


def _enqueue_cuda(
    engine: TransferEngine, made: list[Any], stages: list[tuple[int, ...]], handle: LayeredLoad
) -> None:
    stream = engine._streams[made[0][0].lane] if made else None
    # Timed events: a stage's bandwidth is the time between two (bench_layerwise.py).
    handle.events = [torch.cuda.Event(enable_timing=True) for _ in stages]
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(engine.device))
    for job, _ in made:
        job.start = torch.cuda.Event(enable_timing=True)
        job.end = torch.cuda.Event(enable_timing=True)
        engine._queues[job.lane].append(job)
    recorded = 0
    try:
        with torch.cuda.device(engine.device), torch.cuda.stream(stream):
            prepared = [_job_runs(engine, job, table, stages, stream) for job, table in made]
            stream.wait_event(ready)
            for job, _ in made:
                job.start.record(stream)
            for number in range(len(stages)):
                for per_stage, _ in prepared:
                    for run in per_stage[number]:
                        run()
                handle.events[number].record(stream)
                recorded += 1
            for (job, _), (_, tail) in zip(made, prepared, strict=True):
                for run in tail:
                    run()
                job.end.record(stream)
    except BaseException as error:
        handle.fail_all()
        # Whatever was enqueued still runs; every wait and job end follows it.
        for event in handle.events[recorded:]:
            event.record(stream)
        for job, _ in made:
            job.end.record(stream)
        if isinstance(error, Exception):
            logger.exception("layer-staged load jobs %s failed", list(handle.job_ids))
        else:
            raise
    finally:
        for job, _ in made:
            job.holds.release_after(job.end)
            job.finished.set()


def _run_cpu(
    engine: TransferEngine, made: list[Any], stages: list[tuple[int, ...]], handle: LayeredLoad
) -> None:
    start = time.perf_counter()
    try:
        with engine._lock:
            settled = any(job.finished.is_set() for job, _ in made)
        if settled:
            return  # the submit was interrupted and failed the jobs: copy nothing
        with engine._copy_locks[EXPEDITED_LOAD]:
            if engine._closed:
                # shutdown released the pool while this thread was on its way to the lock
                # (shutdown takes every copy lock first, so a copy holding it is safe):
                # the runs would move bytes by raw address from released memory.
                logger.error(
                    "layer-staged load jobs %s failed: the engine was shut down before they copied",
                    list(handle.job_ids),
                )
                handle.fail_all()
                return
            prepared = [_job_runs(engine, job, table, stages, None) for job, table in made]
            for number in range(len(stages)):
                for per_stage, _ in prepared:
                    for run in per_stage[number]:
                        run()
                handle.events[number].set()
            for _, tail in prepared:
                for run in tail:
                    run()
    except Exception:
        logger.exception("layer-staged load jobs %s failed", list(handle.job_ids))
        handle.fail_all()
    finally:
        elapsed = time.perf_counter() - start
        with engine._lock:
            for job, _ in made:
                if job.finished.is_set():
                    continue  # settled by an interrupted submit, reported from there
                job.transfer_time = elapsed
                job.holds.release_after(None)
                engine._finished.append(job)
                job.finished.set()
        for event in handle.events:
            event.set()  # released in any case (a failed stage fails the jobs above)
        handle._ended.set()


__all__ = ["STAGE_WAIT_SECONDS", "LayeredLoad", "check_stages", "submit_layered"]
