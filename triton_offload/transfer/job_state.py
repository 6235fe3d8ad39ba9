"""The engine's lanes and the state of a job from its submit to its report.

Shared by the engine (``triton_offload.transfer.engine``) and its layer-staged loads
(``triton_offload.transfer.layered``), which builds jobs of the same kind: kept apart so
that neither imports the other.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from triton_offload.transfer.checksums import PageChecksums
from triton_offload.transfer.copiers import JobHolds
from triton_offload.transfer.jobs import FROM_POOL, TO_POOL
from triton_offload.transfer.selection import Assignment, path_name

#: The lane of expedited loads, beside ``TO_POOL`` (stores) and ``FROM_POOL`` (loads):
#: its own FIFO queue, stream and copy lock.
EXPEDITED_LOAD = 2
LANES = (TO_POOL, FROM_POOL, EXPEDITED_LOAD)

#: Wakes the threads waiting in :meth:`JobFinished.wait` (one for every job: waiters are
#: rare, a job is made per submit, and a ``threading.Event`` per job costs a condition
#: and a lock to build).
_WAKE = threading.Condition(threading.Lock())


class JobFinished:
    """A job's "finished" flag: ``set``/``is_set``/``wait`` as ``threading.Event``'s.

    ``set`` takes no lock unless a thread waits. That is safe because ``wait`` counts
    itself under ``_WAKE`` before it reads the flag and ``set`` writes the flag before it
    reads the count: a ``set`` that read no waiter wrote the flag before that waiter
    read it, and one that read a waiter notifies under ``_WAKE``, which the waiter only
    gives up inside ``_WAKE.wait()``.
    """

    __slots__ = ("_flag",)
    waiting = 0  # threads inside wait(), every job together; changed under _WAKE

    def __init__(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        if JobFinished.waiting:
            with _WAKE:
                _WAKE.notify_all()

    def wait(self) -> None:
        with _WAKE:
            JobFinished.waiting += 1
            try:
                while not self._flag:
                    _WAKE.wait()
            finally:
                JobFinished.waiting -= 1


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job: bytes moved and the device time between its start and end.

    ``transfer_size`` counts every page of every plane the job addressed (bytes);
    ``transfer_time`` is in seconds (CUDA events on CUDA, wall clock on CPU), from
    after the job's host preparation to the end of its last copy.
    A job that failed while running has ``success=False``.
    """

    job_id: Hashable
    success: bool
    transfer_size: int
    transfer_time: float
    #: The page checksums of a job submitted with ``checksum=True`` that succeeded.
    checksums: PageChecksums | None = None
    #: The copiers that moved it, as the engine names a job's path (``"torch"``,
    #: ``"triton"``, ``"dma"``, or ``"dma+triton"`` for a job split between them): how
    #: the job ran, not its outcome, so results compare without it.
    path: str = field(default="", compare=False)


@dataclass(slots=True)
class RunningJob:
    """One accepted job in the engine's books, from its submit until it is reported.

    ``path`` is ``path_name(assignment)`` (the engine keeps it per assignment).
    """

    job_id: Hashable
    direction: int
    assignment: Assignment
    transfer_size: int
    lane: int
    path: str = ""
    success: bool = True
    transfer_time: float = 0.0
    start: Any = None  # torch.cuda.Event
    end: Any = None  # torch.cuda.Event
    holds: JobHolds = field(default_factory=JobHolds)
    # Set once the copy returned or failed (CPU) or was enqueued (CUDA: end recorded).
    finished: JobFinished = field(default_factory=JobFinished)
    checksum: bool = False
    # Checksummed jobs: the algorithm, the rows and the host copy of their sums (read
    # once ended), or the sums computed on the host (CPU path).
    checksum_algorithm: str = ""
    checksum_rows: np.ndarray | None = None
    checksum_values: Any = None
    checksum_seconds: float = 0.0  # the host's hashing (CPU path)

    def done(self) -> bool:
        return self.end is None or bool(self.end.query())

    def result(self) -> TransferResult:
        if self.start is None and not self.checksum:  # the CPU path's plain job
            path = self.path or path_name(self.assignment)
            return TransferResult(
                self.job_id, self.success, self.transfer_size, self.transfer_time, None, path
            )
        seconds = self.transfer_time
        if self.success and self.start is not None and self.end is not None:
            seconds = self.start.elapsed_time(self.end) / 1e3
        checksums = None
        if self.success and self.checksum and self.checksum_rows is not None:
            values = self.checksum_values
            if isinstance(values, torch.Tensor):
                values = values.numpy().view(np.uint64).copy()
            checksums = PageChecksums(
                self.checksum_rows, values, self.checksum_algorithm, self.checksum_seconds
            )
        return TransferResult(
            self.job_id,
            self.success,
            self.transfer_size,
            seconds,
            checksums,
            self.path or path_name(self.assignment),
        )


__all__ = ["EXPEDITED_LOAD", "LANES", "JobFinished", "RunningJob", "TransferResult"]
