"""No accepted job is stranded or reported twice, whatever line an interrupt lands on.

The guarantee (engine and vLLM worker alike): every job that ``submit_store`` /
``submit_load`` accepted (returned True, or raised ``KeyboardInterrupt`` /
``SystemExit`` after the job entered the books) is reported exactly once by a later
``get_finished``; an interrupted submit of a job that never entered the books is never
reported, and its id can be submitted again. An interrupted job may be reported failed.

The fuzz drives a random sequence of ``submit_store`` / ``submit_load`` /
``get_finished`` / ``wait`` calls and, with ``sys.settrace`` line tracing restricted to
the engine's and the worker's modules, raises ``KeyboardInterrupt`` (or ``SystemExit``)
at the k-th line event of a call (k random: any line of the call, helpers of those
modules included). The driver catches it and goes on; an interrupted submit is retried
at once, uninterrupted, and its answer says whether the first try had entered the
books (``ValueError: ... in flight``) or not (True). Each round ends by draining
everything and checking: every accepted id reported exactly once, nothing else
reported. A failure names the seed (``TRITON_OFFLOAD_FUZZ_SEED``) and, per set of lines
a round was interrupted at, how many jobs were lost, duplicated or left unfinished.

Bounded: ``TRITON_OFFLOAD_FUZZ_INTERRUPTS`` interrupts per target (default
``FUZZ_INTERRUPTS``: about 6 s for the engine, 16 s for the worker, on one core).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import functools
import linecache
import logging
import os
import random
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import torch

from tests.helpers.interrupter import ENGINE_FILE, Interrupter, WorkerTarget, _worker_file, waitable
from triton_offload import GroupSpec, plan_offload
from triton_offload.transfer.engine import TransferEngine
from triton_offload.transfer.jobs import JobSpec

#: Interrupts per target (engine, worker): about 6 s and 16 s on one core.
FUZZ_INTERRUPTS = int(os.environ.get("TRITON_OFFLOAD_FUZZ_INTERRUPTS", "5000"))
FUZZ_SEED = int(os.environ.get("TRITON_OFFLOAD_FUZZ_SEED", "20250107"))
#: Calls per round; a round ends with a full drain and the exactly-once check, so each
#: loss or duplicate is pinned to the few interrupts of its round.
ROUND_CALLS = 10


# ----------------------------------------------------------------------------- tracer


def site_text(site: tuple[str, int, str] | None) -> str:
    if site is None:
        return "no interrupt"
    name, line, function = site
    path = ENGINE_FILE if name == "engine.py" else _worker_file()
    return f"{name}:{line} {function}: {linecache.getline(path, line).strip()}"


# ----------------------------------------------------------------------------- targets


class EngineTarget:
    """A CPU-path ``TransferEngine`` (backend "torch", page checksums on)."""

    blocks, rows = 8, 6

    def __init__(self) -> None:
        self.files = {ENGINE_FILE}
        plan = plan_offload([GroupSpec("full_attention", 16)], blocks_per_chunk=1)
        self.cache = torch.randint(0, 256, (self.blocks, 48), dtype=torch.uint8)
        self.engine = TransferEngine(
            plan, [[self.cache]], self.rows, backend="torch", page_checksums=True
        )

    def submit(self, rng: random.Random, store: bool, job_id: int) -> Callable[[], bool]:
        count = rng.randint(1, 3)
        gpu = [rng.sample(range(self.blocks), count)]
        host = [rng.sample(range(self.rows), count)]
        checksum = rng.random() < 0.5
        if store:
            return lambda: self.engine.submit_store(
                job_id, gpu_blocks=gpu, host_blocks=host, checksum=checksum
            )
        expedited = rng.random() < 0.3
        return lambda: self.engine.submit_load(
            job_id, gpu_blocks=gpu, host_blocks=host, checksum=checksum, expedited=expedited
        )

    def get_finished(self) -> list[Any]:
        return list(self.engine.get_finished())

    def wait(self, ids: list[Hashable]) -> None:
        self.engine.wait(ids)

    def waitable(self, ids: list[Hashable]) -> list[Hashable]:
        return waitable(self.engine, ids)

    def close(self) -> None:
        self.engine.shutdown()


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class Tally:
    interrupts: int = 0
    calls: int = 0
    accepted: int = 0
    reported: int = 0
    sites: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    #: (problem, the interrupted lines of its round) -> jobs. Problems: lost (never
    #: reported), unfinished (in the books, never marked finished: wait would hang),
    #: duplicated (reported again), unaccepted (reported, never accepted), error.
    problems: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    example: str = ""

    def problem(self, kind: str, sites: list[tuple[str, int, str]], note: str) -> None:
        where = " + ".join(site_text(site) for site in sites) or "no interrupt"
        self.problems[(kind, where)] += 1
        if not self.example:
            self.example = f"{note} (round interrupted at {where})"

    def report(self, name: str, seed: int, seconds: float) -> str:
        lines = [
            f"{name}: seed {seed} (TRITON_OFFLOAD_FUZZ_SEED), {self.interrupts} interrupts at "
            f"{len(self.sites)} distinct lines, {self.calls} calls, {self.accepted} jobs "
            f"accepted, {self.reported} reported, {seconds:.1f} s",
        ]
        by_kind: collections.Counter = collections.Counter()
        for (kind, _), count in self.problems.items():
            by_kind[kind] += count
        lines.append("problems: " + (", ".join(f"{k} {n}" for k, n in by_kind.items()) or "none"))
        for (kind, where), count in sorted(self.problems.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count:4d} {kind:10s} in a round interrupted at {where}")
        if self.example:
            lines.append(f"first: {self.example}")
        return "\n".join(lines)


def fuzz(make_target: Callable[[], Any], interrupts: int, seed: int) -> tuple[Tally, float]:
    """Rounds of ``ROUND_CALLS`` random calls, 1 to 3 of them armed to be interrupted,
    each round ending with a drain and the exactly-once check; a problem is counted
    against the lines its round was interrupted at."""
    rng = random.Random(seed)
    target = make_target()
    tracer = Interrupter(target.files)
    tally = Tally()
    # Line events seen in an uninterrupted call of each kind: the range k is drawn from.
    longest: collections.Counter = collections.Counter({"store": 60, "load": 60})
    longest.update({"get_finished": 40, "wait": 10})
    next_id = 0
    outstanding: set[int] = set()  # accepted, not yet reported
    unfinished: set[int] = set()  # outstanding, but wait on them would hang
    reported: set[int] = set()
    given_up: set[int] = set()  # counted lost by an earlier drain (a later report is not counted)
    sites: list[tuple[str, int, str]] = []  # this round's interrupts
    began = time.perf_counter()

    def call(kind: str, function: Callable[[], Any], armed: bool) -> Any:
        """The call's value; None with the interrupt recorded when one landed."""
        tally.calls += 1
        at = rng.randint(1, longest[kind] + 2) if armed else 0
        error = KeyboardInterrupt if rng.random() < 0.8 else SystemExit
        try:
            value = tracer.call(function, at, error)
        except (KeyboardInterrupt, SystemExit) as caught:
            assert tracer.site is not None and isinstance(caught, error)
            tally.interrupts += 1
            tally.sites[tracer.site] += 1
            sites.append(tracer.site)
            return None
        except Exception as caught:  # an error is a finding; the run goes on
            tally.problem("error", sites, f"{kind}: {caught!r}")
            return None
        longest[kind] = max(longest[kind], tracer.count)
        return value

    def received(results: list[Any]) -> None:
        for result in results:
            tally.reported += 1
            job_id = result.job_id
            if job_id in outstanding:
                outstanding.discard(job_id)
                unfinished.discard(job_id)
                reported.add(job_id)
            elif job_id not in given_up:
                kind = "duplicated" if job_id in reported else "unaccepted"
                tally.problem(kind, sites, f"job {job_id} reported ({kind})")

    def submit(kind: str, armed: bool) -> None:
        nonlocal next_id
        job_id, next_id = next_id, next_id + 1
        function = target.submit(rng, kind == "store", job_id)
        before = tally.interrupts
        accepted = call(kind, function, armed)
        if tally.interrupts > before:
            try:
                accepted = function()  # uninterrupted: did the first try enter the books?
            except ValueError as refused:
                accepted = "in flight" in str(refused)
                if not accepted:
                    tally.problem("error", sites, f"retry of job {job_id}: {refused!r}")
            except Exception as caught:
                tally.problem("error", sites, f"retry of job {job_id}: {caught!r}")
        if accepted:
            tally.accepted += 1
            outstanding.add(job_id)

    def drain() -> None:
        ready = target.waitable(sorted(outstanding - unfinished))
        for job_id in outstanding - unfinished - set(ready):
            unfinished.add(job_id)
            tally.problem("unfinished", sites, f"job {job_id} never marked finished")
        try:
            target.wait(ready)
        except Exception as caught:
            tally.problem("error", sites, f"drain: wait: {caught!r}")
        for _ in range(2):
            try:
                received(target.get_finished())
            except Exception as caught:
                tally.problem("error", sites, f"drain: get_finished: {caught!r}")
        for job_id in sorted(outstanding):
            tally.problem("lost", sites, f"job {job_id} never reported")
        given_up.update(outstanding)
        outstanding.clear()
        unfinished.clear()

    try:
        while tally.interrupts < interrupts:
            armed = set(rng.sample(range(ROUND_CALLS), rng.choice((1, 1, 1, 2, 3))))
            sites.clear()
            for number in range(ROUND_CALLS):
                choice = rng.random()
                if choice < 0.5:
                    submit("store" if choice < 0.25 else "load", number in armed)
                elif choice < 0.8:
                    results = call("get_finished", target.get_finished, number in armed)
                    received(results or [])
                else:
                    ids = [i for i in sorted(outstanding - unfinished) if rng.random() < 0.5]
                    ready = target.waitable(ids)
                    call("wait", lambda ready=ready: target.wait(ready), number in armed)
            drain()
    finally:
        target.close()
    return tally, time.perf_counter() - began


def run_fuzz(name: str, make_target: Callable[[], Any]) -> None:
    # A hang (a job stranded in a way the guard misses, a lock left held) ends the run
    # with every thread's stack instead of blocking the suite.
    faulthandler.dump_traceback_later(600, exit=True)
    # Failed verifications and failed jobs log at every interrupt: thousands of lines.
    logging.disable(logging.CRITICAL)
    try:
        tally, seconds = fuzz(make_target, FUZZ_INTERRUPTS, FUZZ_SEED)
    finally:
        logging.disable(logging.NOTSET)
        faulthandler.cancel_dump_traceback_later()
    summary = tally.report(name, FUZZ_SEED, seconds)
    print(summary)
    assert not tally.problems, summary
    # Not vacuous: the interrupts landed all over the paths that keep the books.
    functions = {function for _, _, function in tally.sites}
    assert {"_submit", "_run_cpu", "get_finished"} <= functions, sorted(functions)
    assert tally.accepted > FUZZ_INTERRUPTS // 2, summary


def test_engine_reports_every_accepted_job_once_whatever_line_is_interrupted() -> None:
    run_fuzz("engine", EngineTarget)


def test_worker_reports_every_accepted_job_once_whatever_line_is_interrupted() -> None:
    pytest.importorskip("vllm")
    run_fuzz("worker", WorkerTarget)


# ------------------------------------------------------------------ focused regressions


def _engine_with_stores(count: int) -> TransferEngine:
    engine = EngineTarget().engine
    for job in range(count):
        assert engine.submit_store(job, gpu_blocks=[[job]], host_blocks=[[job]])
    return engine


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_interrupt_just_after_get_finished_took_the_jobs_loses_none(nth: int) -> None:
    """The known hole: the finished jobs were taken off the queue above the ``try`` that
    puts them back, so an interrupt on either line between (the n-th line event once
    the queue is empty) lost every one."""
    engine = _engine_with_stores(3)
    tracer = Interrupter({ENGINE_FILE})

    def taken(frame: Any) -> bool:
        return frame.f_code.co_name == "get_finished" and not engine._finished

    tracer.condition = taken
    with pytest.raises(KeyboardInterrupt):
        tracer.call(engine.get_finished, nth, KeyboardInterrupt)
    assert tracer.site is not None and tracer.site[2] == "get_finished"
    results = engine.get_finished()
    assert sorted((r.job_id, r.success) for r in results) == [(0, True), (1, True), (2, True)]
    assert engine.get_finished() == []
    engine.wait([])


@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_after_the_job_entered_the_books_reports_it_once(
    nth: int, error: type[BaseException]
) -> None:
    """Found by the fuzz: an interrupt after ``_submit`` put the job in the books and
    before the copy's ``finally`` queued it (the last_job_* lines, the copy lock's line)
    left it unreported for ever, and ``wait`` on it hung. Now it is reported once
    (failed, or whole if the copy had returned) and its id is refused until then."""
    target = EngineTarget()
    engine = target.engine
    tracer = Interrupter({ENGINE_FILE})
    tracer.condition = lambda frame: "cut" in engine._active

    def submit() -> bool:
        return engine.submit_store("cut", gpu_blocks=[[1, 3]], host_blocks=[[0, 2]])

    with pytest.raises(error):
        tracer.call(submit, nth, error)
    with pytest.raises(ValueError, match="already in flight"):
        submit()
    assert waitable(engine, ["cut"]) == ["cut"]  # marked finished: wait returns
    assert engine.in_flight("cut")
    engine.wait(["cut"])
    assert [r.job_id for r in engine.get_finished()] == ["cut"]
    assert engine.get_finished() == [] and not engine.in_flight("cut")
    assert submit()  # the id is free again
    (result,) = engine.get_finished()
    assert result.success and torch.equal(engine.pool[0], target.cache[1])


def _sealed_worker() -> Any:
    return WorkerTarget().worker


def _store(worker: Any, job_id: int, chunk: int, blocks: list[int]) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec

    host = KeyedCPULoadStoreSpec([chunk], [f"key-{chunk}".encode()])
    assert worker.submit_store(job_id, GPULoadStoreSpec(blocks, [len(blocks), 0], [0, 0]), host)


def _load(worker: Any, job_id: int, chunk: int, blocks: list[int]) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from triton_offload.vllm.integrity import KeyedCPULoadStoreSpec

    host = KeyedCPULoadStoreSpec([chunk], [f"key-{chunk}".encode()])
    assert worker.submit_load(job_id, host, GPULoadStoreSpec(blocks, [len(blocks), 0], [0, 0]))


@contextlib.contextmanager
def _sealed_worker_with_three_stores() -> Iterator[Any]:
    """A sealed worker that accepted stores 0, 1 and 2 (job j: chunk j from blocks 2j and
    2j + 1), not yet reported; shut down after."""
    worker = _sealed_worker()
    try:
        for job in range(3):
            _store(worker, job, chunk=job, blocks=[2 * job, 2 * job + 1])
        yield worker
    finally:
        worker.shutdown()


def _interrupt_second_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


@pytest.mark.parametrize("caller", ["get_finished", "wait"])
def test_an_interrupt_while_the_worker_seals_stores_loses_none(
    caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The known hole: sealing ran on results the loop alone held, after the job left
    the books; an interrupt while sealing the second of three stores lost the second and
    the third. Now all three are reported once, sealed (a load of each verifies)."""
    pytest.importorskip("vllm")
    with _sealed_worker_with_three_stores() as worker:
        calls = _interrupt_second_call(monkeypatch, worker.sealer, "seal_pages")
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished() if caller == "get_finished" else worker.wait([0, 1, 2])
        assert calls[0] == 2
        monkeypatch.undo()
        results = worker.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(0, True), (1, True), (2, True)]
        assert worker.get_finished() == []
        for job in range(3):
            _load(worker, 10 + job, chunk=job, blocks=[6 + 2 * job, 7 + 2 * job])
        results = worker.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(j, True) for j in (10, 11, 12)]


@pytest.mark.parametrize("caller", ["get_finished", "wait"])
def test_an_interrupt_while_the_worker_verifies_loads_loses_none(
    caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same for a load's verdict: an interrupt while verifying the second of three loads
    (comparing its seals) lost the second and the third. Now the verdicts are computed
    again and each load is reported once, verified."""
    pytest.importorskip("vllm")
    with _sealed_worker_with_three_stores() as worker:
        assert len(worker.get_finished()) == 3
        for job in range(3):
            _load(worker, 10 + job, chunk=job, blocks=[6 + 2 * job, 7 + 2 * job])
        calls = _interrupt_second_call(monkeypatch, worker.sealer, "all_accepted")
        with pytest.raises(KeyboardInterrupt):
            worker.get_finished() if caller == "get_finished" else worker.wait([10, 11, 12])
        assert calls[0] == 2
        monkeypatch.undo()
        results = worker.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(j, True) for j in (10, 11, 12)]
        assert worker.get_finished() == []


def test_an_interrupt_at_the_worker_s_return_keeps_its_results() -> None:
    """Found by the fuzz: ``get_finished`` handed its results over in one line and
    returned them on the next; an interrupt on the ``return`` line lost them all."""
    pytest.importorskip("vllm")
    target = WorkerTarget()
    worker = target.worker
    try:
        for job in range(2):
            _store(worker, job, chunk=job, blocks=[2 * job, 2 * job + 1])
        tracer = Interrupter(target.files)

        def returning(frame: Any) -> bool:
            code = frame.f_code
            text = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return code is type(worker).get_finished.__code__ and text.startswith("return")

        tracer.condition = returning
        with pytest.raises(KeyboardInterrupt):
            tracer.call(worker.get_finished, 1, KeyboardInterrupt)
        assert sorted(r.job_id for r in worker.get_finished()) == [0, 1]
        assert worker.get_finished() == []
    finally:
        worker.shutdown()


def test_a_worker_submit_interrupted_before_the_engine_took_the_job_leaves_no_books(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the fuzz: the worker opened the job's books, then the interrupt landed
    before the engine took the job; the books stayed for a job never reported (its id
    refused as in flight for ever). Now they are closed: the id can be submitted again."""
    pytest.importorskip("vllm")
    worker = _sealed_worker()
    try:
        engine = worker.engine

        def interrupted(*args: Any, **kwargs: Any) -> bool:
            raise KeyboardInterrupt

        monkeypatch.setattr(engine, "submit_store", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _store(worker, 5, chunk=0, blocks=[0, 1])
        monkeypatch.undo()
        assert worker.get_finished() == []
        _store(worker, 5, chunk=0, blocks=[0, 1])  # not "already in flight"
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(5, True)]
    finally:
        worker.shutdown()


def test_a_layer_staged_submit_interrupted_at_any_line_reports_each_job_once() -> None:
    """``submit_layered_loads`` interrupted at every line event in turn (the engine's
    and ``transfer.layered``'s lines, the copy thread's excluded: it is not the caller's
    thread): each job the engine holds afterwards is reported exactly once, never
    hangs a stage wait, and a job it does not hold is never reported. Before, an
    interrupt after the jobs entered the books and before the copy thread started left
    them there, never reported."""
    from triton_offload.transfer import layered as layered_module

    files = {ENGINE_FILE, layered_module.__file__}
    lines_seen = 0
    for at in range(1, 400):
        engine = EngineTarget().engine
        tracer = Interrupter(files)
        ids = [f"staged-{at}-a", f"staged-{at}-b"]
        jobs = [(ids[0], JobSpec.of(None, gpu_blocks=[[1, 2]], host_blocks=[[0, 1]])),
                (ids[1], JobSpec.of(None, gpu_blocks=[[5]], host_blocks=[[4]]))]  # fmt: skip
        handle = None
        submit = functools.partial(engine.submit_layered_loads, jobs, [[0]])
        with contextlib.suppress(KeyboardInterrupt):
            handle = tracer.call(submit, at, KeyboardInterrupt)
        held = [job_id for job_id in ids if engine.in_flight(job_id)]
        if handle is not None:
            assert handle.join(10.0) in (True, False)
            assert held == ids
        deadline = time.monotonic() + 60.0  # a hang guard: a copy thread that started ends soon
        while waitable(engine, held) != held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waitable(engine, held) == held, (at, tracer.site, "stranded")
        engine.wait(held)
        reported = [result.job_id for result in engine.get_finished()]
        assert sorted(reported) == sorted(held), (at, tracer.site, reported, held)
        assert engine.get_finished() == [] and not any(map(engine.in_flight, ids))
        engine.shutdown()
        if tracer.site is None:  # the call ran to its end: every line was interrupted
            lines_seen = at - 1
            break
    assert lines_seen > 10
