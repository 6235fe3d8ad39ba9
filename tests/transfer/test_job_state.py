"""JobFinished: the engine's per-job "finished" flag, waited on by ``engine.wait``."""

from __future__ import annotations

import threading

from triton_offload.transfer.job_state import JobFinished

HANG_GUARD_S = 60.0


def _waiter(flag: JobFinished, woke: list[JobFinished]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (flag.wait(), woke.append(flag)), daemon=True)
    thread.start()
    return thread


def test_wait_returns_at_once_when_set() -> None:
    flag = JobFinished()
    assert not flag.is_set()
    flag.set()
    assert flag.is_set()
    flag.wait()  # set before: returns without a setter
    assert JobFinished.waiting == 0


def test_set_wakes_only_the_waiters_of_its_job() -> None:
    first, second = JobFinished(), JobFinished()
    woke: list[JobFinished] = []
    threads = [_waiter(first, woke), _waiter(first, woke), _waiter(second, woke)]
    # Hang guard only: ends as soon as all three wait.
    deadline = threading.Event()
    for _ in range(int(HANG_GUARD_S * 100)):
        if JobFinished.waiting == 3:
            break
        deadline.wait(0.01)
    assert JobFinished.waiting == 3
    first.set()
    threads[0].join(HANG_GUARD_S)
    threads[1].join(HANG_GUARD_S)
    assert woke == [first, first]
    assert threads[2].is_alive() and not second.is_set()
    second.set()
    threads[2].join(HANG_GUARD_S)
    assert woke == [first, first, second]
    assert JobFinished.waiting == 0
