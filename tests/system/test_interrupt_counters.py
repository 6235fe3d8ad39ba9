"""Interrupts while the worker drains: counters count each job once, shutdown releases all.

Two guarantees beside ``tests/system/test_interrupt_fuzz.py``'s (every accepted job reported
exactly once, whatever line an interrupt lands on):

- **Counters.** The worker's counters (``vllm:triton_offload_*``: jobs and bytes per copy
  path and direction, ``verify_seconds``, ``chunks_refused``) count every reported job
  exactly once, whatever line of ``get_finished`` or ``wait`` (the engine's, the worker's
  judging of finished jobs, the counters' own lines) an interrupt lands on, and whether or
  not vLLM's connector drained the counters between the interrupt and the retry. The
  oracle is the reports themselves: each job's bytes, its verdict and its refused chunks
  (``bad_keys``); a clock that advances one second per reading makes ``verify_seconds``
  the number of jobs sealed or verified.
- **Replicated layout, shutdown.** A replicated worker (rank 0, which copies and
  publishes stores to the region's ledger, or rank 1, which waits for rank 0's ledger
  entries) interrupted at a line of ``get_finished`` or ``wait`` and then shut down (with
  or without another drain first) raises nothing, does not hang, leaves no thread, keeps
  no view of the region (vLLM's "Keeping ... mapped" warning) and, once both ranks shut
  down, no mapping of the region or the ledger (``/proc/self/maps``) and no file in
  ``/dev/shm``. Every accepted job is reported exactly once by the ``get_finished`` calls
  before or after the shutdown (the worker keeps the reports it has not handed over), and
  rank 0 publishes every store it had accepted before its ledger goes away, so rank 1
  reports each of them, successful, without waiting for its timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import linecache
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    import triton_offload.vllm as tv
    from tests.helpers.interrupter import Interrupter, WorkerTarget
    from tests.helpers.region_config import region_files, region_mappings
    from tests.helpers.spec_geometry import Caches, _config
    from triton_offload.transfer import cpu_copy as cpu_copy_module
    from triton_offload.transfer import engine as engine_module
    from triton_offload.vllm import counters as counters_module
    from triton_offload.vllm import worker as worker_module
    from triton_offload.vllm.counters import BYTES, CHUNKS_REFUSED, JOBS, VERIFY_SECONDS
    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec
except ImportError as error:  # pragma: no cover - exercised where vllm is absent
    pytest.skip(f"vllm cannot be imported: {error}", allow_module_level=True)

#: Rounds of the counter fuzz, at most one interrupt each: about 3 s on one core.
ROUNDS = int(os.environ.get("TRITON_OFFLOAD_COUNTER_FUZZ_ROUNDS", "2000"))
SEED = int(os.environ.get("TRITON_OFFLOAD_FUZZ_SEED", "20250107"))
#: Line events interrupted per case of the replicated shutdown test (0: every line, about
#: 430 for rank 0's drain): about 1 s per case on one core.
SHUTDOWN_LINES = int(os.environ.get("TRITON_OFFLOAD_SHUTDOWN_FUZZ_LINES", "40"))
#: Longest a shutdown may take before it counts as hung.
SHUTDOWN_S = 20.0
TRACED = {worker_module.__file__, counters_module.__file__, engine_module.__file__}


class OneSecondClock:
    """Stands in for the worker's ``time``: ``perf_counter`` advances one second per
    reading, so each sealing or verification the worker times (two readings) counts one
    second, and a retried one (its first reading lost to the interrupt) one as well.
    The engine's hashing (also verification time) is timed on a clock that stands still
    (:class:`StoppedClock`): it adds nothing, and each job counts exactly one second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.monotonic = time.monotonic

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


class StoppedClock:
    """Stands in for the CPU copy path's ``time``: every reading is the same."""

    def perf_counter(self) -> float:
        return 0.0


def site_text(site: tuple[str, int, str] | None) -> str:
    if site is None:
        return "no interrupt"
    name, line, function = site
    path = next(path for path in TRACED if path.endswith(name))
    return f"{name}:{line} {function}: {linecache.getline(path, line).strip()}"


# ------------------------------------------------------------------------ counters


@dataclasses.dataclass
class Expected:
    """What the reports say the counters must hold, by (counter, label)."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def report(self, result: Any, direction: str) -> None:
        # CPU copies always complete: every reported job was a copy that moved its bytes.
        self.counts[(JOBS, direction)] += 1
        self.counts[(BYTES, direction)] += int(result.transfer_size)
        if direction == "load":
            self.counts[(VERIFY_SECONDS, "load")] += 1  # every load is verified
            self.counts[(CHUNKS_REFUSED, "host")] += len(getattr(result, "bad_keys", ()))
        elif result.success:
            self.counts[(VERIFY_SECONDS, "store")] += 1  # a sealed store (sealing ok)


def counted(drained: dict[str, dict[tuple[str, ...], Any]]) -> collections.Counter:
    """``Counters.drain()`` summed per (counter, direction or tier), paths summed."""
    total: collections.Counter = collections.Counter()
    for name, series in drained.items():
        for labels, value in series.items():
            if name in (JOBS, BYTES):
                total[(name, labels[1])] += value  # (path, direction)
            elif name == VERIFY_SECONDS:
                total[(name, labels[0])] += value
            elif name == CHUNKS_REFUSED:
                total[(name, labels[1])] += value  # (reason, tier)
    return total


def test_each_reported_job_is_counted_once_whatever_line_of_the_drain_is_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rounds of 1 to 4 jobs (stores and loads, sealed; some loads fail their seal),
    then ``get_finished`` or ``wait`` interrupted at a random line event, sometimes the
    counters drained as the connector does, then a full drain and the check: the counts
    equal what the reports say, each job once."""
    monkeypatch.setattr(worker_module, "time", OneSecondClock())
    monkeypatch.setattr(cpu_copy_module, "time", StoppedClock())
    rng = random.Random(SEED)
    target = WorkerTarget()
    worker = target.worker
    tracer = Interrupter(TRACED)
    expected = Expected()
    total: collections.Counter = collections.Counter()
    direction: dict[int, str] = {}
    outstanding: set[int] = set()
    reported: collections.Counter = collections.Counter()
    longest = {"get_finished": 60, "wait": 60}
    sites: collections.Counter = collections.Counter()
    wrong: collections.Counter = collections.Counter()  # (site, what) -> rounds
    next_id = 0
    began = time.perf_counter()

    def received(results: list[Any]) -> None:
        for result in results:
            reported[result.job_id] += 1
            outstanding.discard(result.job_id)
            expected.report(result, direction[result.job_id])

    logging.disable(logging.CRITICAL)  # failed verifications log at every round
    try:
        for _ in range(ROUNDS):
            for _ in range(rng.randint(1, 4)):
                store = rng.random() < 0.5
                assert target.submit(rng, store, next_id)()
                direction[next_id] = "store" if store else "load"
                outstanding.add(next_id)
                next_id += 1
            kind = rng.choice(("get_finished", "wait"))
            call: Callable[[], Any] = worker.get_finished
            if kind == "wait":
                call = functools.partial(worker.wait, sorted(outstanding))
            at = rng.randint(1, longest[kind] + 2)
            error = KeyboardInterrupt if rng.random() < 0.8 else SystemExit
            site = None
            try:
                value = tracer.call(call, at, error)
            except (KeyboardInterrupt, SystemExit):
                site = tracer.site
                sites[site] += 1
            else:
                longest[kind] = max(longest[kind], tracer.count)
                received(value or [])
            if rng.random() < 0.5:
                total += counted(worker.counters.drain())  # the connector, each step
            for _ in range(2):  # traced, not interrupted: counts the lines a drain runs
                received(tracer.call(worker.get_finished, 0, KeyboardInterrupt))
                longest["get_finished"] = max(longest["get_finished"], tracer.count)
            total += counted(worker.counters.drain())
            assert not outstanding, f"jobs {sorted(outstanding)} never reported ({site})"
            for key in set(total) | set(expected.counts):
                if total[key] != expected.counts[key]:
                    wrong[(site_text(site), f"{key[0]}[{key[1]}]")] += 1
            total = collections.Counter(expected.counts)  # the next round starts even
    finally:
        logging.disable(logging.NOTSET)
        worker.shutdown()
    seconds = time.perf_counter() - began
    lines = [
        f"seed {SEED}: {ROUNDS} rounds, {next_id} jobs, {sum(sites.values())} interrupts at "
        f"{len(sites)} lines, {seconds:.1f} s",
        "  in " + ", ".join(sorted({function for _, _, function in sites})),
    ]
    lines += [f"  {n:4d} rounds: {what} miscounted, interrupted at {where}"
              for (where, what), n in wrong.most_common()]  # fmt: skip
    summary = "\n".join(lines)
    print(summary)
    assert not wrong, summary
    assert sorted(reported.values()) == [1] * next_id, "a job was reported twice"
    # Not vacuous: the interrupts landed all over the judging of finished jobs.
    functions = {function for _, _, function in sites}
    assert {"_drain_engine", "_judged", "_load_result", "_seal_store"} <= functions, functions
    assert expected.counts[(CHUNKS_REFUSED, "host")] > 0  # some loads failed their seal


def test_a_store_interrupted_while_it_is_sealed_is_counted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The known hole: a finished store's job and bytes were counted, then the
    interrupt landed while it was sealed, and the retried drain counted them again."""
    worker = WorkerTarget().worker
    try:
        blocks = GPULoadStoreSpec([0, 1], [2, 0], [0, 0])
        assert worker.submit_store(1, blocks, KeyedCPULoadStoreSpec([0], [b"key-0"]))
        original = worker.sealer.seal_pages

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            monkeypatch.setattr(worker.sealer, "seal_pages", original)
            raise KeyboardInterrupt

        monkeypatch.setattr(worker.sealer, "seal_pages", interrupted)
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished()
        (result,) = worker.get_finished()
        assert (result.job_id, result.success) == (1, True)
        drained = worker.counters.drain()
        assert sum(drained[JOBS].values()) == 1, drained
        assert sum(drained[BYTES].values()) == result.transfer_size, drained
        assert list(drained[VERIFY_SECONDS]) == [("store",)]
    finally:
        worker.shutdown()


def test_a_load_interrupted_after_a_chunk_was_refused_counts_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same for a load whose chunk fails its seal: the refusal was counted, then the
    interrupt landed (here: in the warning that names the chunk), and the retried
    verification counted the chunk and the job again."""
    worker = WorkerTarget().worker
    try:
        blocks = GPULoadStoreSpec([0, 1], [2, 0], [0, 0])
        assert worker.submit_load(2, KeyedCPULoadStoreSpec([3], [b"key-3"]), blocks)

        class Interrupting:
            def warning(self, *args: Any) -> None:
                monkeypatch.setattr(worker_module, "logger", original)
                raise KeyboardInterrupt

        original = worker_module.logger
        monkeypatch.setattr(worker_module, "logger", Interrupting())
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished()
        (result,) = worker.get_finished()
        assert (result.job_id, result.success, result.bad_keys) == (2, False, (b"key-3",))
        drained = worker.counters.drain()
        assert drained[CHUNKS_REFUSED] == {("empty", "host"): 1}, drained
        assert sum(drained[JOBS].values()) == 1, drained
    finally:
        worker.shutdown()


# ------------------------------------------------------- replicated layout, shutdown


class VllmRecords(logging.Handler):
    """Every record of vLLM's loggers (they do not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        """Warnings and errors (vLLM's "Keeping ... mapped" among them)."""
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


def replicated_worker(engine_id: str, rank: int) -> Any:
    """Rank ``rank`` of two under ``replicated_layout``, seals on, CPU path; both ranks
    of one engine live in this process (rank 0 creates the region and the ledger)."""
    base = _config({"backend": "torch", "verify_chunks": True})
    config = dataclasses.replace(
        base,
        engine_id=engine_id,
        replicated_layout=True,
        parallel=dataclasses.replace(base.parallel, rank=rank),
    )
    worker = tv.TritonOffloadingSpec(config).get_worker(Caches(seed=rank).canonical)
    assert worker.writer is (rank == 0) and worker.ledger is not None
    return worker


def store(worker: Any, job_id: int) -> None:
    """Store job ``job_id``: chunk ``job_id`` from GPU blocks ``2j`` and ``2j + 1``."""
    source = GPULoadStoreSpec([2 * job_id, 2 * job_id + 1], [2, 0], [0, 0])
    host = KeyedCPULoadStoreSpec([job_id], [f"key-{job_id}".encode()])
    assert worker.submit_store(job_id, source, host)


def shut_down(worker: Any) -> None:
    """``worker.shutdown()``, failing (not hanging) when it does not return in time."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.shutdown()
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="shutdown", daemon=True)
    thread.start()
    thread.join(SHUTDOWN_S)
    assert not thread.is_alive(), "shutdown hung"
    if errors:
        raise errors[0]


@dataclasses.dataclass
class Outcome:
    """One interrupted drain: where it landed and what went wrong after it."""

    site: tuple[str, int, str] | None
    problems: list[str]
    lines: int  # line events the call ran (up to the interrupt)


def interrupted_then_shut_down(rank: int, caller: str, drain_first: bool, at: int) -> Outcome:
    """Rank 0 and rank 1 accept stores 0, 1 and 2; rank 0 reports (publishes) 0 and 1
    first when rank 1 is the one interrupted. Rank ``rank``'s ``caller`` is interrupted
    at its ``at``-th line event (0: never); it drains again if ``drain_first``, then shuts down,
    then the other rank; what the contract says is checked on the way."""
    engine_id = f"interrupt-{uuid.uuid4().hex}"
    threads = set(threading.enumerate())
    problems: list[str] = []
    handler = VllmRecords()
    logging.getLogger("vllm").addHandler(handler)
    # Not region.py: a trace function's exception at the body of its ``with _fence_lock:
    # pass`` (a NOP outside the block's exception range) skips the lock's release, which
    # no signal can do (CPython runs handlers only at calls and backward jumps).
    tracer = Interrupter(TRACED)
    writer, reader = replicated_worker(engine_id, 0), replicated_worker(engine_id, 1)
    try:
        for job in range(3):
            store(reader, job)
        target, other = (writer, reader) if rank == 0 else (reader, writer)
        reports: collections.Counter = collections.Counter()
        other_reports: collections.Counter = collections.Counter()
        if rank == 1:
            for job in range(2):
                store(writer, job)
            other_reports.update(r.job_id for r in writer.get_finished())  # publishes 0, 1
            store(writer, 2)  # not published until rank 0 drains or shuts down
            waited = [0, 1]  # rank 1's wait on job 2 would wait for rank 0 (a timeout)
        else:
            for job in range(3):
                store(writer, job)
            waited = [0, 1, 2]
        call = target.get_finished if caller == "get_finished" else lambda: target.wait(waited)
        try:
            value = tracer.call(call, at, KeyboardInterrupt)
            reports.update(r.job_id for r in value or [])
        except KeyboardInterrupt:
            pass
        if drain_first:
            reports.update(r.job_id for r in target.get_finished())
        handler.records.clear()
        try:
            shut_down(target)
        except Exception as error:
            problems.append(f"shutdown raised {error!r}")
        if handler.warnings():
            problems.append(f"shutdown warned: {handler.warnings()}")
        try:
            reports.update(r.job_id for r in target.get_finished())
            reports.update(r.job_id for r in target.get_finished())
        except Exception as error:
            problems.append(f"get_finished after shutdown raised {error!r}")
        if reports != collections.Counter(range(3)):
            problems.append(f"rank {rank} reported {dict(reports)}, not 0, 1, 2 once each")
        if rank == 0:
            # Rank 0 published every store before its ledger went away: no wait.
            results = reader.get_finished()
            if sorted((r.job_id, r.success) for r in results) != [(j, True) for j in range(3)]:
                problems.append(f"rank 1 got {[(r.job_id, r.success) for r in results]}")
        else:
            other_reports.update(r.job_id for r in writer.get_finished())
            if other_reports != collections.Counter(range(3)):
                problems.append(f"rank 0 reported {dict(other_reports)}")
        handler.records.clear()
        shut_down(other)
        if handler.warnings():
            problems.append(f"shutdown warned: {handler.warnings()}")
    finally:
        logging.getLogger("vllm").removeHandler(handler)
        for worker in (writer, reader):
            if worker.region is not None:  # released here, not by the next round
                try:
                    worker.shutdown()
                except Exception as error:
                    problems.append(f"second shutdown raised {error!r}")
                problems.append("a worker was not shut down")
    if region_mappings(engine_id):
        problems.append(f"still mapped: {region_mappings(engine_id)}")
    if region_files(engine_id):
        problems.append(f"files left: {region_files(engine_id)}")
    left = [t.name for t in set(threading.enumerate()) - threads if t.name != "shutdown"]
    if left:
        problems.append(f"threads left: {left}")
    return Outcome(tracer.site, problems, tracer.count)


@pytest.mark.parametrize("drain_first", [False, True], ids=["shutdown-at-once", "drained-first"])
@pytest.mark.parametrize("caller", ["get_finished", "wait"])
@pytest.mark.parametrize("rank", [0, 1], ids=["rank0-writer", "rank1-reader"])
def test_a_replicated_worker_interrupted_while_draining_shuts_down_cleanly(
    rank: int, caller: str, drain_first: bool
) -> None:
    """``SHUTDOWN_LINES`` line events of the call drawn at random (0: every one in turn),
    and the call run to its end, each on a fresh pair of ranks."""
    whole = interrupted_then_shut_down(rank, caller, drain_first, at=0)
    assert whole.site is None and whole.lines > 3, whole
    lines = range(1, whole.lines + 1)
    if SHUTDOWN_LINES:
        seed = SEED + 4 * rank + 2 * (caller == "wait") + drain_first
        lines = sorted(random.Random(seed).sample(lines, min(SHUTDOWN_LINES, len(lines))))
    failures: collections.Counter = collections.Counter()
    for outcome in [whole, *(interrupted_then_shut_down(rank, caller, drain_first, at)
                             for at in lines)]:  # fmt: skip
        for problem in outcome.problems:
            failures[(problem.split(":")[0][:90], site_text(outcome.site))] += 1
    summary = "\n".join(
        f"  {n:3d} x {problem} (interrupted at {where})"
        for (problem, where), n in failures.most_common()
    )
    assert not failures, f"rank {rank}, {caller}, drain first {drain_first}:\n{summary}"
