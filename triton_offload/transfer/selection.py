"""Path choice: which copier moves which planes of a job, and the calibration behind it.

Copy-engine DMA beats SM copies for large pages, SM copies win for many small pages,
and a hybrid job mixes both (KiB-scale attention pages, MB-scale Mamba SSM pages). So
``auto`` decides per plane, from the plane's page bytes and the pages it has in the
job, per direction: one job may launch the kernel for some planes and a DMA batch for
the others, on one stream with one completion. ``per_job`` mode (one copier for the
whole job, from its mean page size) is kept for comparison in the benchmarks.

The crossover is measured at start-up through the engine's own submit path on its real
layout (its planes, grid and staging; both directions; runs merged as in real jobs), or
configured as a page-size threshold.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from triton_offload.transfer.jobs import DIRECTION_NAMES, FROM_POOL, TO_POOL, JobSpec
from triton_offload.transfer.layout import CacheLayout

if TYPE_CHECKING:
    from triton_offload.transfer.engine import TransferEngine

logger = logging.getLogger(__name__)

#: One part of a job: the copier's name and the plane indices it moves (None: all).
Assignment = tuple[tuple[str, tuple[int, ...] | None], ...]
PathChoice = Literal["plane", "job"]
PATH_CHOICES = ("plane", "job")


def path_name(assignment: Assignment) -> str:
    """A job's copy path as the engine names it: its copiers joined by ``+`` (``"torch"``,
    ``"triton"``, ``"dma"``, ``"dma+triton"``)."""
    return "+".join(name for name, _ in assignment)


@dataclass(frozen=True)
class Crossover:
    """Per direction, the winner measured at grid points (page bytes, pages per job).

    A point ``(page bytes, blocks)`` is labelled by what its calibration job moved:
    ``blocks`` pages of each of ``planes[point]`` planes. ``threshold`` (configured)
    overrides the grid: DMA for pages of at least that many bytes. ``timings`` keeps the
    measured device seconds per point and copier, ``host_timings`` the host seconds to
    prepare and enqueue the same jobs (for ``info``; the choice uses device time).
    """

    grid: Mapping[int, Mapping[tuple[int, int], str]] = field(default_factory=dict)
    threshold: Mapping[int, int] | None = None
    timings: Mapping[int, Mapping[tuple[int, int], Mapping[str, float]]] = field(
        default_factory=dict
    )
    host_timings: Mapping[int, Mapping[tuple[int, int], Mapping[str, float]]] = field(
        default_factory=dict
    )
    planes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    #: The spin cycles that held each timed job's lane at the end of the calibration
    #: (None: configured, not measured).
    gate_cycles: int | None = None

    def choose(self, direction: int, page_bytes: float, pages: int) -> str:
        if self.threshold is not None:
            return "dma" if page_bytes >= self.threshold[direction] else "triton"
        points = self.grid.get(direction)
        if not points:
            return "triton"

        def distance(point: tuple[int, int]) -> tuple[float, float]:
            return (
                abs(math.log2(point[0]) - math.log2(max(page_bytes, 1.0))),
                abs(math.log2(point[1]) - math.log2(max(pages, 1))),
            )

        return points[min(points, key=distance)]

    def describe(self) -> list[str]:
        """One line per grid point (or the threshold): what ``info`` and the log print."""
        if self.threshold is not None:
            return [
                f"{DIRECTION_NAMES[d]}: dma for pages >= {t} bytes (configured)"
                for d, t in sorted(self.threshold.items())
            ]
        lines = []
        for direction, points in sorted(self.grid.items()):
            for (page, pages), winner in sorted(points.items()):
                times = self.timings.get(direction, {}).get((page, pages), {})
                hosts = self.host_timings.get(direction, {}).get((page, pages), {})
                detail = ", ".join(
                    f"{k} {v * 1e6:.1f} us"
                    + (f" (host {hosts[k] * 1e6:.1f} us)" if k in hosts else "")
                    for k, v in sorted(times.items())
                )
                planes = self.planes.get((page, pages))
                moved = f" ({planes} planes, {planes * pages} pages)" if planes else ""
                lines.append(
                    f"{DIRECTION_NAMES[direction]} page {page} B x {pages} blocks{moved}: "
                    f"{winner}" + (f": device {detail}" if detail else "")
                )
        return lines


def parse_crossover(configured: int | Mapping[str, int] | None) -> Crossover | None:
    """A configured DMA/Triton threshold (page bytes), or None to measure it at start-up.

    Checked on every device, so a bad setting fails where it is written, not only on
    the CUDA machine that would use it.
    """
    if configured is None:
        return None
    if isinstance(configured, Mapping):
        if set(configured) != {"store", "load"}:
            raise ValueError(
                f"crossover {dict(configured)!r} needs exactly the keys 'store' and 'load'"
            )
        values = {TO_POOL: configured["store"], FROM_POOL: configured["load"]}
    else:
        values = {TO_POOL: configured, FROM_POOL: configured}
    for direction, value in values.items():
        name = f"crossover[{DIRECTION_NAMES[direction]!r}]"
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int of page bytes, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} {value} must be >= 0 page bytes")
    return Crossover(threshold={int(direction): int(v) for direction, v in values.items()})


#: Block counts remembered per (direction, group) by :class:`CrossoverPath`.
_MEMO_LIMIT = 1 << 16


class PathPolicy:
    """Decides a job's assignment of planes to copiers."""

    def assign(self, direction: int, counts: Sequence[int]) -> Assignment:
        """``counts[g]``: GPU blocks of group g in the job."""
        raise NotImplementedError


class FixedPath(PathPolicy):
    """Every plane of every job by one copier."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._all: Assignment = ((name, None),)

    def assign(self, direction: int, counts: Sequence[int]) -> Assignment:
        return self._all


class CrossoverPath(PathPolicy):
    """``auto``: per plane (``"plane"``) or per job (``"job"``) from a :class:`Crossover`."""

    def __init__(self, layout: CacheLayout, crossover: Crossover, mode: PathChoice) -> None:
        if mode not in PATH_CHOICES:
            raise ValueError(f"path choice {mode!r} is not one of {PATH_CHOICES}")
        self.layout = layout
        self.crossover = crossover
        self.mode = mode
        self._page_bytes = [p.page_bytes for p in layout.planes]
        self._bytes_per_block = layout.bytes_per_block
        self._planes_per_group = [len(p) for p in layout.group_planes]
        # A plane's winner depends on (direction, its page bytes, its group's block
        # count) only, so per group the winners of all its planes are one of a few
        # tuples (page classes x count buckets of the grid). Each distinct tuple gets an
        # id; per (direction, group) a memo maps a block count to that id, so a job costs
        # one dict lookup per group instead of a grid search (log2 per point) per plane:
        # ~480 us per job on a 160-plane layout before, ~1.5 us after
        # (bench_host_cost.py, test_path_choice_per_job).
        self._group_pages = [
            sorted({self._page_bytes[i] for i in members}) for members in layout.group_planes
        ]
        self._class_ids: dict[tuple[str, ...], int] = {}
        self._classes: list[tuple[str, ...]] = []
        self._memo: dict[tuple[int, int], dict[int, int]] = {}
        self._cache: dict[tuple[int, tuple[int, ...]], Assignment] = {}

    def _group_class(self, direction: int, group: int, count: int) -> int:
        """The id of group ``group``'s plane winners for a job with ``count`` of its blocks."""
        memo = self._memo.get((direction, group))
        if memo is None:
            memo = self._memo[(direction, group)] = {}
        found = memo.get(count)
        if found is not None:
            return found
        members = self.layout.group_planes[group]
        if count:
            by_page = {
                page: self.crossover.choose(direction, page, count)
                for page in self._group_pages[group]
            }
            winners = tuple(by_page[self._page_bytes[i]] for i in members)
        else:
            winners = ("",) * len(members)  # planes of a group the job does not touch
        found = self._class_ids.get(winners)
        if found is None:
            found = self._class_ids[winners] = len(self._classes)
            self._classes.append(winners)
        # Counts are bounded by the group's blocks; the cap only bounds memory for a
        # caller that sends ever larger counts (beyond it the choice is recomputed).
        if len(memo) < _MEMO_LIMIT:
            memo[count] = found
        return found

    def assign(self, direction: int, counts: Sequence[int]) -> Assignment:
        choose = self.crossover.choose
        if self.mode == "job":
            pages = sum(c * p for c, p in zip(counts, self._planes_per_group, strict=True))
            size = sum(c * b for c, b in zip(counts, self._bytes_per_block, strict=True))
            return ((choose(direction, size / max(pages, 1), pages), None),)
        classes = tuple(
            self._group_class(direction, group, int(count)) for group, count in enumerate(counts)
        )
        key = (direction, classes)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        winners = [w for c in classes for w in self._classes[c]]
        names = sorted({w for w in winners if w})
        if len(names) <= 1:
            result: Assignment = ((names[0] if names else "triton", None),)
        else:
            result = tuple(
                (name, tuple(i for i, w in enumerate(winners) if w == name)) for name in names
            )
        # Few distinct assignments exist (page-size classes x count buckets): a bounded
        # cache keeps the per-job cost to the group lookups and one dict lookup.
        if len(self._cache) < 4096:
            self._cache[key] = result
        return result


#: Calibration grid: pages per plane in a job, i.e. the GPU blocks of the job's group
#: (the page sizes are the layout's own). 256 is above a real job's 128 blocks (a
#: 2k-token prompt at 16-token blocks), 16 a short one's.
CALIBRATION_PAGES = (16, 256)
#: Bytes per calibration job at most; keeps the whole start-up measurement to a few ms.
#: When a point's blocks x planes exceed it, the job moves fewer of the group's planes
#: (each with the point's block count), and fewer blocks only once one plane alone
#: exceeds it: a point is labelled by the blocks it moved, and a plane's choice in a
#: real job depends on its block count (see ``CrossoverPath``).
CALIBRATION_MAX_BYTES = 16 << 20
#: Timed repeats per point (after one warm-up job), median taken.
CALIBRATION_REPEATS = 3


def describe_paths(policy: PathPolicy, layout: CacheLayout) -> str:
    """Which copier moves which planes, for a start-up log line: one copier for every
    plane, or per page size the copier of each direction (at the calibration's job sizes,
    :data:`CALIBRATION_PAGES` blocks, where the choice depends on the job)."""
    if isinstance(policy, FixedPath):
        return f"every plane by {policy.name}"
    if not isinstance(policy, CrossoverPath):
        return f"chosen by {type(policy).__name__}"
    if policy.mode == "job":
        return "one copier per job, from its mean page size and the crossover"
    planes: dict[int, int] = {}
    for plane in layout.planes:
        planes[plane.page_bytes] = planes.get(plane.page_bytes, 0) + 1
    parts = []
    for page, count in sorted(planes.items()):
        directions = []
        for direction in _DIRECTIONS:
            picks = [policy.crossover.choose(direction, page, n) for n in CALIBRATION_PAGES]
            choice = (
                picks[0]
                if len(set(picks)) == 1
                else " / ".join(
                    f"{pick} at {n} blocks"
                    for pick, n in zip(picks, CALIBRATION_PAGES, strict=True)
                )
            )
            directions.append(f"{DIRECTION_NAMES[direction]} {choice}")
        parts.append(f"{count} planes of {page} B: " + ", ".join(directions))
    return "; ".join(parts)


def calibration_slice(rows: object, num_rows: int) -> range:
    """The k-th of n equal, disjoint slices of ``range(num_rows)`` for ``rows = (k, n)``.

    Ranks whose pools share rows pass distinct k: their calibrations store into and
    load from disjoint rows, so none loads another's bytes into its caches.
    """
    if (
        not isinstance(rows, tuple)
        or len(rows) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in rows)
    ):
        raise TypeError(f"calibration_rows must be a tuple (k, n) of two ints, got {rows!r}")
    k, n = int(rows[0]), int(rows[1])
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"calibration_rows {rows!r} needs n >= 1 and 0 <= k < n")
    if n > num_rows:
        raise ValueError(
            f"calibration_rows {rows!r}: {n} slices of {num_rows} pool rows leave some empty"
        )
    return range(k * num_rows // n, (k + 1) * num_rows // n)


def _calibration_page_sizes(layout: CacheLayout, limit: int = 4) -> list[int]:
    sizes = sorted({plane.page_bytes for plane in layout.planes})
    if len(sizes) <= limit:
        return sizes
    picks = np.linspace(0, len(sizes) - 1, limit).round().astype(int)
    return sorted({sizes[i] for i in picks})


@dataclass(frozen=True)
class CalibrationJob:
    """One grid point's job: ``blocks`` GPU blocks of one group (the point's label), each
    moving its page of every plane in ``planes`` (all ``page`` bytes)."""

    spec: JobSpec
    page: int
    blocks: int
    planes: tuple[int, ...]


def calibration_job(
    engine: TransferEngine, page: int, wanted: int, rng: np.random.Generator
) -> CalibrationJob | None:
    """A job of about ``wanted`` blocks on the group with the most planes of ``page`` bytes.

    Blocks are capped by the group's blocks and the calibration rows only; the byte cap
    takes planes away first (spread over the group's layers), and blocks only when a
    single plane of ``wanted`` blocks exceeds it.
    """
    layout = engine.layout
    best = max(
        range(layout.num_groups),
        key=lambda g: sum(layout.planes[i].page_bytes == page for i in layout.group_planes[g]),
    )
    planes = tuple(i for i in layout.group_planes[best] if layout.planes[i].page_bytes == page)
    if not planes:
        return None
    bpc = layout.blocks_per_chunk
    own_rows = np.asarray(engine.calibration_rows, dtype=np.int64)
    blocks = min(
        wanted,
        layout.group_num_blocks[best],
        own_rows.size * bpc,
        max(1, CALIBRATION_MAX_BYTES // page),
    )
    count = max(1, min(len(planes), CALIBRATION_MAX_BYTES // (page * blocks)))
    chosen = tuple(planes[i] for i in np.linspace(0, len(planes) - 1, count).round().astype(int))
    # Scattered blocks and rows, as in real jobs (runs merge only where they would).
    gpu_blocks = rng.permutation(layout.group_num_blocks[best])[:blocks]
    rows = own_rows[rng.permutation(own_rows.size)[: -(-blocks // bpc)]]
    gpu = [gpu_blocks if g == best else [] for g in range(layout.num_groups)]
    host = [rows if g == best else [] for g in range(layout.num_groups)]
    return CalibrationJob(JobSpec(gpu, host), page, blocks, tuple(sorted(set(chosen))))


@dataclass(frozen=True)
class TimedRun:
    """One calibration job's seconds: ``device_s`` between its start and end events,
    ``host_s`` to prepare and enqueue it; ``gated``: the lane was held until the whole
    job was enqueued (so ``device_s`` holds no host time)."""

    device_s: float
    host_s: float
    gated: bool


#: Spin cycles that first hold a lane before a timed calibration job: ~1 ms at the
#: 1.98 GHz boost clock of an H100/H200. A calibration job is at most a few thousand
#: pages, and DMA submission costs ~0.5 us per descriptor (DESIGN.md, section 5): about
#: 0.5 ms for 1,000 runs. A job that outlasts its gate doubles it (see GatedTimer.run).
GATE_CYCLES = 2_000_000
#: ~135 ms at 2 GHz: past this the enqueue itself is the problem, not the gate.
MAX_GATE_CYCLES = 1 << 28


class GatedTimer:
    """Times one job at a time through an engine's own path, its device time apart from
    its host time (calibration, the bench's grid sweep).

    On an idle stream the start event completes as soon as it is recorded, and the copy
    follows only when the host has enqueued it: the span would count Python and driver
    enqueue time (biasing small jobs toward whichever copier enqueues faster). So the
    lane is first held by a spin kernel (``torch.cuda._sleep``) that outlasts the enqueue
    of the whole job; the start event then completes when the copy can begin. If the gate
    ended before the job was enqueued (its event already completed), the job is run again
    behind a gate twice as long, and ``cycles`` stays doubled for later jobs. Without
    CUDA the copy is timed alone (the engine's wall clock around it).
    """

    def __init__(self, engine: TransferEngine, cycles: int = GATE_CYCLES) -> None:
        self.engine = engine
        self.cycles = cycles

    def run(self, spec: JobSpec, direction: int, assignment: Assignment) -> TimedRun:
        engine = self.engine
        if not engine.cuda:
            began = time.perf_counter()
            result = engine.run_unreported(spec, direction, assignment)
            wall = time.perf_counter() - began
            return TimedRun(result.transfer_time, wall - result.transfer_time, gated=True)
        import torch

        lane = engine.lane_stream(direction)
        while True:
            gate = torch.cuda.Event()
            with torch.cuda.device(engine.device), torch.cuda.stream(lane):
                torch.cuda._sleep(self.cycles)
                gate.record(lane)
            began = time.perf_counter()
            job = engine.start_unreported(spec, direction, assignment)
            host = time.perf_counter() - began
            held = not gate.query()
            result = engine.finish_unreported(job)
            if held or self.cycles >= MAX_GATE_CYCLES:
                return TimedRun(result.transfer_time, host, gated=held)
            self.cycles *= 2


def _time_point(
    timer: GatedTimer | Any, job: CalibrationJob, names: tuple[str, ...]
) -> dict[int, dict[str, tuple[float, float]]]:
    """Per direction and copier: median (device, host) seconds of the point's job."""
    device: dict[int, dict[str, list[float]]] = {d: {n: [] for n in names} for d in _DIRECTIONS}
    host: dict[int, dict[str, list[float]]] = {d: {n: [] for n in names} for d in _DIRECTIONS}
    for repeat in range(CALIBRATION_REPEATS + 1):
        for name in names:
            for direction in _DIRECTIONS:
                run = timer.run(job.spec, direction, ((name, job.planes),))
                if repeat:  # the first round warms up (compilation, first touch)
                    device[direction][name].append(run.device_s)
                    host[direction][name].append(run.host_s)
    return {
        d: {n: (float(np.median(device[d][n])), float(np.median(host[d][n]))) for n in names}
        for d in _DIRECTIONS
    }


_DIRECTIONS = (TO_POOL, FROM_POOL)


def calibrate(
    engine: TransferEngine,
    names: tuple[str, str] = ("triton", "dma"),
    timer: GatedTimer | None = None,
) -> Crossover:
    """Time the copiers against each other per direction, through the engine's submit path.

    Grid: each distinct page size of the layout (up to 4) x ``CALIBRATION_PAGES`` blocks,
    each point keyed by the blocks its job really moved (two wanted counts that cap to
    the same blocks are one point). Each point is a real job on the engine's own layout
    restricted to planes of that size (one group), timed by the engine's own start/end
    events with the lane held until the job was enqueued (:class:`GatedTimer`, or
    ``timer``: device time only; host time is kept apart), stores and loads alternating
    on the same blocks and rows: a load writes back the bytes the store just read, so the
    caches end as they began. Pool rows in ``engine.calibration_rows`` are overwritten
    (at construction the engine has stored nothing yet); no other row is touched.
    """
    timer = GatedTimer(engine) if timer is None else timer
    rng = np.random.default_rng(0)
    grid: dict[int, dict[tuple[int, int], str]] = {d: {} for d in _DIRECTIONS}
    timings: dict[int, dict[tuple[int, int], dict[str, float]]] = {d: {} for d in _DIRECTIONS}
    host: dict[int, dict[tuple[int, int], dict[str, float]]] = {d: {} for d in _DIRECTIONS}
    planes: dict[tuple[int, int], int] = {}
    for page in _calibration_page_sizes(engine.layout):
        for wanted in CALIBRATION_PAGES:
            job = calibration_job(engine, page, wanted, rng)
            if job is None or (page, job.blocks) in planes:
                continue
            key = (page, job.blocks)
            planes[key] = len(job.planes)
            for direction, medians in _time_point(timer, job, names).items():
                device_s = {n: t[0] for n, t in medians.items()}
                grid[direction][key] = min(device_s, key=device_s.__getitem__)
                timings[direction][key] = device_s
                host[direction][key] = {n: t[1] for n, t in medians.items()}
    crossover = Crossover(
        grid=grid, timings=timings, host_timings=host, planes=planes, gate_cycles=timer.cycles
    )
    for line in crossover.describe():
        logger.info("calibration %s", line)
    return crossover


__all__ = [
    "CALIBRATION_MAX_BYTES",
    "CALIBRATION_PAGES",
    "PATH_CHOICES",
    "Assignment",
    "CalibrationJob",
    "Crossover",
    "CrossoverPath",
    "FixedPath",
    "PathChoice",
    "PathPolicy",
    "calibrate",
    "calibration_job",
    "calibration_slice",
    "describe_paths",
    "parse_crossover",
    "path_name",
]
