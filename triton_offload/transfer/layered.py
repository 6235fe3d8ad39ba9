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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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


def stage_assignment(assignment: Any, stage: tuple[int, ...], num_planes: int) -> Any:
    """The job's (copier, planes) restricted to one stage's planes (empty parts dropped)."""
    wanted = set(stage)
    parts = []
    for name, planes in assignment:
        chosen = tuple(p for p in (range(num_planes) if planes is None else planes) if p in wanted)
        if chosen:
            parts.append((name, None if len(chosen) == num_planes else chosen))
    return tuple(parts)


__all__ = ["STAGE_WAIT_SECONDS", "LayeredLoad", "check_stages", "stage_assignment"]
