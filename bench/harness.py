"""Runs cases on paths: verify byte-exact first, then time; plus host cost and a CPU
correctness pass of the Triton kernels under the interpreter.

Timing, per (case, path, direction): ``warmup`` untimed jobs, then ``repeats`` jobs one
at a time; the figure is the median. A run with a budget (``Config.max_seconds``, the
command's own, less its start-up and the report's reserve) stops starting cases and
paths at its deadline, and stops the jobs of the path running then (after one timed
job), which says so in its note. A row whose jobs spread widely, or that beat the
ceiling, is noise (:func:`noise_of`): the report draws no verdict from it.

Device time on CUDA comes from CUDA events recorded on the path's stream around the
job (the engine records its own events around each job on its transfer stream and
reports them as ``transfer_time``). Without CUDA every path is synchronous and the time
is the wall clock from submit to finish. Host time is the wall clock of the submit call
alone (on CUDA: building the job's tables and enqueueing it; without CUDA it includes
the copy).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from triton_offload.bench import cases
from triton_offload.bench.cases import Case, GroupShape
from triton_offload.bench.paths import (
    CEILING,
    PathRunner,
    PathUnavailable,
    Workspace,
    build_workspace,
    make_path,
    plan_for,
    role_of,
)

from triton_offload.transfer.jobs import JobSpec
from triton_offload.transfer.pointers import blocks_from_pointers, device_planes

#: Paths that run on a CPU-only machine as timed measurements. "auto" is not among
#: them: without CUDA it *is* the torch path, and timing one path twice only showed
#: run-to-run noise as a fake difference between the two (6.8 vs 5.4 GB/s in one run).
CPU_TIMED_PATHS = ("torch", "per-page-copy", "index-copy", CEILING)
#: Paths that are another path on a CPU-only machine: measured once, under that name.
CPU_SAME_AS = {"auto": "torch"}
#: Paths that run on a CPU-only machine only as an interpreted correctness pass.
CPU_INTERPRETED_PATHS = ("triton", "flat-triton")
#: A per-page baseline over this many descriptors is skipped: in Python it costs
#: several microseconds per page, minutes over a sweep, and says nothing new.
MAX_PER_PAGE_DESCRIPTORS = 20_000


def gbps(num_bytes: int, seconds: float) -> float:
    """Decimal gigabytes per second: ``num_bytes / seconds / 1e9``."""
    if seconds <= 0:
        raise ValueError(f"seconds {seconds} must be > 0")
    return num_bytes / seconds / 1e9


def percent_of(value: float, ceiling: float) -> float:
    if ceiling <= 0:
        raise ValueError(f"ceiling {ceiling} must be > 0")
    return 100.0 * value / ceiling


@dataclass
class Measurement:
    """One (case, path, direction): status ``ok`` (timed), ``verified`` (correctness
    only, no GB/s), ``FAILED``, ``unavailable`` or ``skipped`` (``note`` says why)."""

    case: str
    path: str
    role: str
    direction: str
    status: str
    note: str = ""
    job_bytes: int = 0
    job_pages: int = 0
    page_bytes: int = 0
    page_sizes: list[int] = field(default_factory=list)
    sweep: bool = False
    device_s: float | None = None
    host_s: float | None = None
    gbps: float | None = None
    pct_ceiling: float | None = None
    launches: int | None = None
    repeats: int = 0
    #: spread of the timed jobs: GB/s of the slowest and of the fastest one
    gbps_min: float | None = None
    gbps_max: float | None = None
    #: interquartile range of the timed jobs' seconds over their median (None: one job)
    spread: float | None = None
    #: seconds of every timed job, in order (``repeats`` of them)
    job_s: list[float] = field(default_factory=list)


#: A path moves the same bytes as the ceiling's one contiguous copy of them, and does
#: more work: a median over this share of the ceiling's means the machine ran faster
#: during the path's jobs than during the ceiling's, not that the path beat a memcpy.
#: The 5% above 100 allow for two medians of short series of the same copy differing.
NOISY_ABOVE_CEILING_PCT = 105.0
#: A row whose middle half of jobs spread over more than this share of their median
#: time is noise. The differences a verdict ranks are 1.2x-4x; when a quarter of the
#: median separates the 25th from the 75th percentile job, where the median of 3-9 jobs
#: lands is chance at that scale, and a rerun ranks differently (on a loaded 2-core
#: machine a verdict flipped between two identical runs, one of them claiming 339% of
#: the ceiling). The interquartile range, not the range: one job preempted by another
#: process (seen in most CPU rows of 9 or more jobs there) moves neither it nor the
#: median. On the same machine with little else running, 52 of 56 rows of a default and
#: a quick CPU run stayed at or under 20% (most under 10%), and 3 went over 25% (both
#: ceilings of one case among them).
NOISY_SPREAD = 0.25


def spread_of(seconds: list[float]) -> float | None:
    """Interquartile range of ``seconds`` over their median (quartiles interpolated
    between the jobs, so 3 jobs give half their range); None for fewer than 2."""
    if len(seconds) < 2:
        return None
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(seconds)


def noise_of(m: Measurement) -> str | None:
    """Why a timed row's figure is noise (see :data:`NOISY_ABOVE_CEILING_PCT` and
    :data:`NOISY_SPREAD`), or None for a steady one and a row without a figure."""
    if m.status != "ok" or m.gbps is None:
        return None
    above = m.pct_ceiling is not None and m.pct_ceiling > NOISY_ABOVE_CEILING_PCT
    if m.role != "ceiling" and above:
        return (
            f"{m.pct_ceiling:.0f}% of the ceiling: faster than one contiguous copy of the "
            "same bytes, so the machine's speed changed between them"
        )
    if m.spread is not None and m.spread > NOISY_SPREAD:
        ranged = (
            f"; its jobs ranged {m.gbps_min:.2f}-{m.gbps_max:.2f} GB/s"
            if m.gbps_min is not None and m.gbps_max is not None
            else ""
        )
        return (
            f"the middle half of its {m.repeats} jobs spread over {m.spread:.0%} of their "
            f"median{ranged}"
        )
    return None


@dataclass
class HostCost:
    """Host time to prepare one job's tables: this project vs per-(block x layer) pointers."""

    case: str
    blocks: int
    planes: int
    descriptors: int
    project_s: float
    pointer_s: float
    pointer_impl: str
    #: vLLM 0.34's connector worker: ``resolve_device_pointers`` per job (what its own
    #: connector pays before any worker sees the job) ...
    resolve_s: float | None = None
    #: ... and this project's worker behind it: resolution, block ids derived from the
    #: pointers and checked, then the job table (``TritonOffloadingConnector`` on 0.34
    #: skips the first two: its jobs carry block ids, ``project_s``).
    pointer_path_s: float | None = None
    resolve_impl: str = ""

    @property
    def ratio(self) -> float:
        return self.pointer_s / self.project_s


@dataclass
class Config:
    presets: list[str]
    sweep: bool
    directions: list[str]
    repeats: int
    warmup: int
    paths: list[str]
    quick: bool
    device: torch.device
    target_bytes: int | None  # scale cases to this many bytes per job (None: full size)
    sweep_page_bytes: list[int] = field(default_factory=lambda: list(cases.SWEEP_PAGE_BYTES))
    sweep_pages: list[int] = field(default_factory=lambda: list(cases.SWEEP_PAGES))
    sweep_max_bytes: int = 512 * cases.MiB
    #: wall-clock budget of the command: no case or path starts after it and timed jobs
    #: stop at it (None: no limit)
    max_seconds: float | None = None
    #: seconds the command ran before measuring (start-up), spent from ``max_seconds``
    spent_s: float = 0.0
    #: seconds of ``max_seconds`` kept for what the command does after measuring (the
    #: report and plots)
    reserve_s: float = 0.0


@dataclass
class Results:
    environment: dict[str, Any]
    config: dict[str, Any]
    measurements: list[Measurement]
    host_costs: list[HostCost]
    correctness: list[Measurement]
    notes: list[str]
    #: seconds of the whole command, from ``wall_from`` (the process's start where the
    #: command can read it) up to the last moment it set it (before writing a report)
    wall_s: float = 0.0
    #: seconds of the measuring alone (cases, sweep, host cost, interpreted pass)
    measuring_s: float = 0.0
    wall_from: str = "the measuring's start"
    #: per case run: name, description, bytes and pages per job, page sizes, groups
    cases: list[dict[str, Any]] = field(default_factory=list)
    #: None for a complete run; for a cut one: ``signal``, ``phase``, ``where`` (the
    #: phase and its step when the signal landed) and ``message``
    partial: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "partial": self.partial,
            "environment": self.environment,
            "config": self.config,
            "cases": self.cases,
            "measurements": [{**asdict(m), "noise": noise_of(m)} for m in self.measurements],
            "host_costs": [{**asdict(h), "ratio": h.ratio} for h in self.host_costs],
            "correctness": [asdict(m) for m in self.correctness],
            "notes": self.notes,
            "wall_s": self.wall_s,
            "wall_from": self.wall_from,
            "measuring_s": self.measuring_s,
        }


# ----------------------------------------------------------------------- environment


def environment(device: torch.device) -> dict[str, Any]:
    """GPU name, driver, torch/triton/CUDA versions (and the CPU) for every result."""
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "gpu": None,
        "driver": None,
        "cuda_runtime": torch.version.cuda,
    }
    # From the distribution's metadata: importing vllm takes seconds (and can fail
    # without its CUDA dependencies) just to read a version string.
    try:
        info["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        info["vllm"] = None
    info["dma_path"] = None
    if device.type == "cuda":
        from triton_offload.transfer.batch_copy import find_batch_copy

        info["gpu"] = torch.cuda.get_device_name(device)
        info["driver"] = _driver_version()
        # Which DMA path the engine's "dma" backend takes here: the batched call, or
        # the per-run loop and why (named in every result).
        info["dma_path"] = find_batch_copy()[1]
    return info


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    try:
        import ctypes

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"CUDA driver API {version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        return None


# ----------------------------------------------------------------------------- progress


class Progress:
    """A self-written progress bar on stderr (a line per 10% when not a terminal)."""

    def __init__(self, total: int, *, enabled: bool = True, stream: Any = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1
        self._started = time.perf_counter()

    def step(self, label: str) -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        fraction = self.done / self.total
        elapsed = time.perf_counter() - self._started
        if self.tty:
            width = 30
            filled = round(width * fraction)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(
                f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label[:40]:<40}"
            )
            if self.done == self.total:
                self.stream.write("\n")
        else:
            decile = int(fraction * 10)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(f"bench: {self.done}/{self.total} ({elapsed:.0f}s) {label}\n")
        self.stream.flush()


# ------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_job(runner: PathRunner, direction: str, device: torch.device) -> tuple[float, float]:
    """One job: (device or wall seconds, host submit seconds)."""
    if device.type == "cuda" and not runner.self_timed:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(runner.stream):
            start.record(runner.stream)
            t0 = time.perf_counter()
            runner.submit(direction)
            host = time.perf_counter() - t0
            end.record(runner.stream)
        end.synchronize()
        runner.finish()
        return start.elapsed_time(end) / 1e3, host
    t0 = time.perf_counter()
    runner.submit(direction)
    host = time.perf_counter() - t0
    measured = runner.finish()
    wall = time.perf_counter() - t0
    if device.type == "cuda" and measured is not None and measured > 0:
        return measured, host
    return wall, host


def count_device_ops(runner: PathRunner, direction: str, device: torch.device) -> int | None:
    """Kernels + memcpys one job enqueues, counted by the profiler (CUDA only)."""
    if device.type != "cuda":
        return None
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time_job(runner, direction, device)
            _sync(device)
        count = sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)
    except Exception:
        return None
    return count or None  # a job that moves bytes enqueues something: 0 means not traced


def measure(
    runner: PathRunner, direction: str, device: torch.device, repeats: int, warmup: int
) -> tuple[float, float]:
    """Median (device seconds, host seconds) over ``repeats`` jobs after ``warmup``."""
    device_times, host_times = measure_samples(runner, direction, device, repeats, warmup)
    return statistics.median(device_times), statistics.median(host_times)


def measure_samples(
    runner: PathRunner,
    direction: str,
    device: torch.device,
    repeats: int,
    warmup: int,
    deadline: float | None = None,
) -> tuple[list[float], list[float]]:
    """(device seconds, host seconds) of each of ``repeats`` jobs after ``warmup``.

    At ``deadline`` (a ``time.perf_counter()`` value) the warm-up ends and so do the
    timed jobs, after the first: fewer than ``repeats`` come back (one slow path on a
    busy machine overran a 15 s budget by 19 s when only paths checked it)."""
    for _ in range(warmup):
        if _past(deadline):
            break
        time_job(runner, direction, device)
    device_times: list[float] = []
    host_times: list[float] = []
    for _ in range(repeats):
        if device_times and _past(deadline):
            break
        seconds, host = time_job(runner, direction, device)
        device_times.append(seconds)
        host_times.append(host)
    return device_times, host_times


# ------------------------------------------------------------------------------- cases


def cases_for(config: Config) -> tuple[list[Case], list[str]]:
    """Preset cases (scaled without CUDA) and, with ``sweep``, the raw sweep grid."""
    notes: list[str] = []
    selected: list[Case] = []
    for name in config.presets:
        case = cases.CASES[name]
        if config.target_bytes is not None:
            scaled = cases.scale_case(case, config.target_bytes)
            if scaled != case:
                layers = ", ".join(f"{g.name} {g.layers}" for g in scaled.groups)
                notes.append(
                    f"{case.name}: scaled to {scaled.job_bytes / cases.MiB:.1f} MiB per job "
                    f"(layers: {layers}; page shapes unchanged) from "
                    f"{case.job_bytes / cases.MiB:.0f} MiB"
                )
            case = scaled
        selected.append(case)
    if config.sweep:
        sweep, skipped = cases.sweep_cases(
            config.sweep_page_bytes, config.sweep_pages, max_job_bytes=config.sweep_max_bytes
        )
        selected.extend(sweep)
        notes.extend(f"sweep point skipped: {s}" for s in skipped)
    return selected, notes


def _paths_for(config: Config) -> list[str]:
    if config.device.type == "cuda":
        return [p for p in config.paths if p != "index-copy"] + [CEILING]
    wanted = {CPU_SAME_AS.get(p, p) for p in config.paths}
    return [p for p in CPU_TIMED_PATHS if p in wanted and p != CEILING] + [CEILING]


#: Called with (phase, step) at every step of a run: ``cases``/``sweep`` (case, path),
#: ``host-cost`` (preset), ``interpreted`` (case, path). The command uses it to name
#: where an interrupt landed and to print progress; the harness knows no signals.
PhaseHook = Callable[[str, str], None]


def _no_phase(phase: str, step: str) -> None:
    del phase, step


#: Note on the rows of paths that a run's wall-clock budget left out.
CUT_NOTE = "cut: the run's wall-clock budget (--max-seconds) ran out before this path"
#: Note on a row whose timed jobs the budget ended early ("...: 40 of 1000 timed jobs").
CUT_SHORT_NOTE = "cut short by --max-seconds"


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def run_case(
    case: Case,
    config: Config,
    progress: Progress | None = None,
    *,
    deadline: float | None = None,
    on_phase: PhaseHook = _no_phase,
    finished: list[Measurement] | None = None,
) -> list[Measurement]:
    """Verify then time every path of ``config`` on ``case``; the ceiling first.

    Paths not started by ``deadline`` (a ``time.perf_counter()`` value) are reported
    ``skipped`` with :data:`CUT_NOTE`; a path running at the deadline stops its timed
    jobs there (:data:`CUT_SHORT_NOTE`).
    """
    device = config.device
    ws = build_workspace(case, device)
    base = {
        "case": case.name,
        "job_bytes": ws.job_bytes,
        "job_pages": ws.job_pages,
        "page_bytes": case.typical_page_bytes,
        "page_sizes": list(case.page_sizes),
        "sweep": case.sweep,
    }
    names = [n for n in _paths_for(config) if n != CEILING]
    phase = "sweep" if case.sweep else "cases"
    on_phase(phase, f"{case.name}, {CEILING}")
    # The ceiling runs before and after the other paths and the faster of the two
    # counts: on a shared machine one measurement can land in a noisy moment.
    first = _run_path(CEILING, ws, config, base, deadline)
    # Rows are also handed out as each path ends: a run interrupted inside this case
    # keeps the paths it finished (without % of ceiling, set only once all are in).
    finished = [] if finished is None else finished
    finished.extend(first)
    if progress is not None:
        progress.step(f"{case.name} {CEILING}")
    results: list[Measurement] = []
    cut = False
    for name in names:
        if _past(deadline):
            cut = True
            results.extend(
                Measurement(
                    path=name,
                    role=role_of(name),
                    direction=d,
                    status="skipped",
                    note=CUT_NOTE,
                    **base,
                )
                for d in config.directions
            )
        else:
            on_phase(phase, f"{case.name}, {name}")
            rows = _run_path(name, ws, config, base, deadline)
            results.extend(rows)
            finished.extend(rows)
        if progress is not None:
            progress.step(f"{case.name} {name}")
    cut = cut or _past(deadline)
    second = first if cut else _run_path(CEILING, ws, config, base, deadline)
    ceilings = [max(pair, key=lambda m: m.gbps or 0.0) for pair in zip(first, second, strict=True)]
    if not cut:
        # The ceiling's spread covers both passes: how much one contiguous copy of these
        # bytes varied during this case is what a "% of ceiling" has to be read against.
        for kept, pair in zip(ceilings, zip(first, second, strict=True), strict=True):
            lows = [m.gbps_min for m in pair if m.gbps_min is not None]
            highs = [m.gbps_max for m in pair if m.gbps_max is not None]
            if lows and highs:
                kept.gbps_min, kept.gbps_max = min(lows), max(highs)
                kept.repeats = sum(m.repeats for m in pair if m.status == "ok")
                kept.job_s = [t for m in pair if m.status == "ok" for t in m.job_s]
                kept.spread = spread_of(kept.job_s)
                short = [m.note for m in pair if m.note.startswith(CUT_SHORT_NOTE)]
                if short:
                    asked = 2 * 3 * config.repeats
                    kept.note = f"{CUT_SHORT_NOTE}: {kept.repeats} of {asked} timed jobs"
    best = {m.direction: m.gbps for m in ceilings if m.gbps is not None}
    for row in (*ceilings, *results):
        if row.gbps is not None and row.direction in best:
            row.pct_ceiling = percent_of(row.gbps, best[row.direction])
    del ws
    _sync(device)
    return [*ceilings, *results]


def _run_path(
    name: str,
    ws: Workspace,
    config: Config,
    base: dict[str, Any],
    deadline: float | None = None,
) -> list[Measurement]:
    role = role_of(name)

    def rows(status: str, note: str) -> list[Measurement]:
        return [
            Measurement(path=name, role=role, direction=d, status=status, note=note, **base)
            for d in config.directions
        ]

    if name == "per-page-copy" and ws.job_pages > MAX_PER_PAGE_DESCRIPTORS:
        return rows("skipped", f"over {MAX_PER_PAGE_DESCRIPTORS} per-page copies per job")
    try:
        runner = make_path(name, ws)
    except PathUnavailable as why:
        return rows("unavailable", str(why))
    except Exception as error:  # a baseline's optional API may not be what it expects
        message = f"could not set up: {type(error).__name__}: {error}"
        return rows("FAILED" if role == "project" else "unavailable", message)
    note = ""
    try:
        try:
            problem = runner.verify()
        except Exception as error:  # a crash during verification is a failure, not a skip
            problem = f"{type(error).__name__}: {error}"
        if problem is not None:
            return rows("FAILED", f"not byte-exact: {problem}")
        out: list[Measurement] = []
        # The ceiling is one cheap copy: three times the repeats steadies its median.
        repeats = 3 * config.repeats if name == CEILING else config.repeats
        for direction in config.directions:
            if _past(deadline):  # the other direction ran until the deadline
                out.append(
                    Measurement(
                        path=name,
                        role=role,
                        direction=direction,
                        status="skipped",
                        note=CUT_NOTE,
                        **base,
                    )
                )
                continue
            try:
                device_times, host_times = measure_samples(
                    runner, direction, ws.device, repeats, config.warmup, deadline
                )
                device_s = statistics.median(device_times)
                host_s = statistics.median(host_times)
            except Exception as error:
                out.append(
                    Measurement(
                        path=name,
                        role=role,
                        direction=direction,
                        status="FAILED",
                        note=f"{type(error).__name__}: {error}",
                        **base,
                    )
                )
                continue
            launches = runner.launches_per_job(direction)
            if launches is None and not ws.case.sweep:
                # One profiler session (a CUPTI start and teardown) per preset row; the
                # sweep is about bandwidth, and its many cases would pay it each time.
                launches = count_device_ops(runner, direction, ws.device)
            ran = len(device_times)
            out.append(
                Measurement(
                    path=name,
                    role=role,
                    direction=direction,
                    status="ok",
                    note=note
                    if ran == repeats
                    else f"{CUT_SHORT_NOTE}: {ran} of {repeats} timed jobs",
                    device_s=device_s,
                    host_s=host_s,
                    gbps=gbps(ws.job_bytes, device_s),
                    gbps_min=gbps(ws.job_bytes, max(device_times)),
                    gbps_max=gbps(ws.job_bytes, min(device_times)),
                    launches=launches,
                    repeats=ran,
                    spread=spread_of(device_times),
                    job_s=device_times,
                    **base,
                )
            )
        return out
    finally:
        runner.close()


# ---------------------------------------------------------------- interpreter pass


def correctness_case() -> Case:
    """Tiny two-group case with odd page sizes (not multiples of 16) for the interpreter."""
    return Case(
        name="interpreter-check",
        description="tiny correctness case: odd page sizes, two groups",
        groups=(
            GroupShape("attention", "full_attention", 16, 2, (1000, 1000), blocks_per_job=3),
            GroupShape(
                "mamba", "mamba", 16, 1, (264, 4100), blocks_per_job=1, mamba_cache_mode="align"
            ),
        ),
    )


def correctness_pass(
    config: Config,
    progress: Progress | None = None,
    *,
    results: list[Measurement] | None = None,
    on_phase: PhaseHook = _no_phase,
    deadline: float | None = None,
) -> list[Measurement]:
    """Without CUDA: Triton paths under the interpreter, byte-exact check, no GB/s.

    Rows are appended to ``results`` (a new list by default) as each check ends, so an
    interrupted pass leaves the finished ones there. Checks not started by ``deadline``
    are rows ``skipped`` with :data:`CUT_NOTE` (one interpreted check takes seconds)."""
    results = [] if results is None else results
    tiny = [] if config.quick else _tiny_presets(config)
    for case in (correctness_case(), *tiny):
        ws = build_workspace(case, torch.device("cpu"), seed=3)
        for name in [p for p in config.paths if p in CPU_INTERPRETED_PATHS]:
            base = {
                "case": case.name,
                "path": name,
                "role": role_of(name),
                "direction": "store+load",
                "job_bytes": ws.job_bytes,
                "job_pages": ws.job_pages,
                "page_bytes": case.typical_page_bytes,
                "page_sizes": list(case.page_sizes),
            }
            if _past(deadline):
                results.append(Measurement(status="skipped", note=CUT_NOTE, **base))
                continue
            on_phase("interpreted", f"{case.name}, {name}")
            try:
                runner = make_path(name, ws)
            except PathUnavailable as why:
                results.append(Measurement(status="unavailable", note=str(why), **base))
                continue
            except Exception as error:  # a path that could run here but raised: a failure
                note = f"could not set up: {type(error).__name__}: {error}"
                status = "FAILED" if base["role"] == "project" else "unavailable"
                results.append(Measurement(status=status, note=note, **base))
                continue
            try:
                problem = runner.verify()
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
            finally:
                runner.close()
            if problem is None:
                note = "interpreted (TRITON_INTERPRET=1): byte-exact; no GB/s claimed"
                results.append(Measurement(status="verified", note=note, **base))
            else:
                results.append(Measurement(status="FAILED", note=problem, **base))
            if progress is not None:
                progress.step(f"{case.name} {name} (interpreted)")
    return results


def _tiny_presets(config: Config) -> list[Case]:
    """Each selected preset with one layer per group and two blocks: real page shapes."""
    tiny = []
    for name in config.presets:
        case = cases.CASES[name]
        groups = tuple(
            replace(g, layers=1, blocks_per_job=min(g.blocks_per_job, 2)) for g in case.groups
        )
        tiny.append(replace(case, name=f"{case.name}-tiny", groups=groups))
    return tiny


def interpreted_steps(config: Config) -> int:
    names = [p for p in config.paths if p in CPU_INTERPRETED_PATHS]
    return len(names) * (1 + (0 if config.quick else len(config.presets)))


# ------------------------------------------------------------------------- host cost


def vllm_pointer_builder() -> tuple[Callable[..., None] | None, str]:
    """vLLM 0.33's per-(block x layer) pointer function, if vllm imports here."""
    try:
        from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
    except Exception:  # vllm missing, or importable only with its CUDA dependencies
        return None, "numpy re-creation of vLLM 0.33's per-(block x layer) pointer build"
    return compute_sub_block_ptrs, "vllm 0.33 compute_sub_block_ptrs (imported)"


def vllm_pointer_resolver() -> tuple[Callable[..., Any], str]:
    """vLLM 0.34's per-job ``resolve_device_pointers`` if it imports here, else a numpy
    re-creation of it (one vectorized ``base + id * stride`` per ref)."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except Exception:  # vllm missing, older than 0.34, or importable only with CUDA
        return _numpy_resolve_device_pointers, (
            "numpy re-creation of vLLM 0.34's resolve_device_pointers"
        )
    return resolve_device_pointers, "vllm 0.34 resolve_device_pointers (imported)"


def _numpy_resolve_device_pointers(device_spec: Any, kv_caches: Any) -> Any:
    """What vLLM 0.34's ``resolve_device_pointers`` returns, for vLLM-less hosts."""
    from types import SimpleNamespace

    ptrs, sizes, start = [], [], 0
    for size, refs in zip(device_spec.group_sizes, kv_caches.group_data_refs, strict=True):
        ids = device_spec.block_ids[start : start + size].astype(np.uint64)
        start += size
        for ref in refs if size else ():
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            ptrs.append(np.uint64(tensor.data_ptr()) + ids * np.uint64(tensor.stride(0)))
            sizes.append(np.full(size, ref.page_size_bytes, dtype=np.uint64))
    return SimpleNamespace(
        ptrs=np.concatenate(ptrs) if ptrs else np.zeros(0, np.uint64),
        sizes=np.concatenate(sizes) if sizes else np.zeros(0, np.uint64),
        group_block_counts=tuple(device_spec.group_sizes),
        group_data_ref_counts=tuple(len(refs) for refs in kv_caches.group_data_refs),
        block_indices=tuple(device_spec.block_indices),
    )


def _numpy_sub_block_ptrs(
    block_ids: np.ndarray, blocks_per_chunk: int, output: np.ndarray, tensor: torch.Tensor
) -> None:
    """One pointer per block of one plane: ``base + id * row stride`` (blocks_per_chunk 1)."""
    del blocks_per_chunk
    output[:] = tensor.data_ptr() + block_ids.astype(np.uint64) * tensor.stride(0)


@dataclass
class JobPreparation:
    """The two ways of preparing one job of a full-size case, ready to call repeatedly.

    ``project()`` runs ``TransferEngine.build_job_table`` (pair table + complete
    validation), O(blocks). ``pointers()`` builds one source and one destination
    pointer plus a size per (block x plane), plane by plane as vLLM 0.33's worker does,
    O(blocks x planes). The caches and the pool are allocated with ``torch.empty`` and
    never touched: only addresses are computed, so a full-size model costs no memory.
    """

    workspace: Workspace
    engine: Any
    project: Callable[[], object]
    pointers: Callable[[], object]
    pointer_impl: str
    #: vLLM 0.34's resolution alone, and with this project's worker behind it.
    resolve: Callable[[], object] = lambda: None
    pointer_path: Callable[[], object] = lambda: None
    resolve_impl: str = ""

    def close(self) -> None:
        self.engine.shutdown()


def job_preparation(case: Case) -> JobPreparation:
    from triton_offload.transfer.engine import TransferEngine

    ws = build_workspace(case, torch.device("cpu"), seed=5)
    # An untouched pool: the engine would zero-fill its own (GBs for a full-size model).
    pool = torch.empty((ws.num_host_blocks, ws.layout.row_bytes), dtype=torch.uint8)
    engine = TransferEngine(
        plan_for(case), ws.caches, ws.num_host_blocks, backend="torch", pool=pool
    )
    builder, impl = vllm_pointer_builder()
    build = builder if builder is not None else _numpy_sub_block_ptrs
    n = ws.job_pages
    # vLLM keeps int64 descriptor buffers (pinned on CUDA) and fills them per job.
    src = np.empty(n, dtype=np.int64)
    dst = np.empty(n, dtype=np.int64)
    sizes = np.empty(n, dtype=np.int64)
    sides = [
        (plane.group, plane.page_bytes, plane.view, engine.pool_view(index)[:, 0])
        for index, plane in enumerate(ws.layout.planes)
    ]
    block_arrays = [np.asarray(b, dtype=np.int64) for b in ws.gpu_blocks]
    row_arrays = [np.asarray(r, dtype=np.int64) for r in ws.host_rows]

    def pointers() -> None:
        op = 0
        for group, page_bytes, cache_side, pool_side in sides:
            blocks = block_arrays[group]
            end = op + blocks.size
            build(blocks, 1, src[op:end].view(np.uint64), cache_side)
            build(row_arrays[group], 1, dst[op:end].view(np.uint64), pool_side)
            sizes[op:end] = page_bytes
            op = end

    def project() -> object:
        return engine.build_job_table(JobSpec(ws.gpu_blocks, ws.host_rows), 0)

    resolve_fn, resolve_impl = vllm_pointer_resolver()
    kv_caches, planes, device_spec = _vllm_034_job(ws)

    def resolve() -> object:
        return resolve_fn(device_spec, kv_caches)

    def pointer_path() -> object:
        blocks = blocks_from_pointers(resolve_fn(device_spec, kv_caches), planes, "bench job")
        bounds = np.cumsum([0, *blocks.group_sizes])
        gpu = [blocks.block_ids[bounds[g] : bounds[g + 1]] for g in range(len(planes))]
        return engine.build_job_table(JobSpec(gpu, ws.host_rows), 0)

    return JobPreparation(ws, engine, project, pointers, impl, resolve, pointer_path, resolve_impl)


def _vllm_034_job(ws: Workspace) -> tuple[Any, Any, Any]:
    """The case's caches as vLLM 0.34's ``CanonicalKVCaches`` (one int8 tensor and one
    ref per plane, as its connector worker builds them for these layouts), the device
    planes this project's worker derives from them, and the job as a GPU spec."""
    from types import SimpleNamespace

    tensors, refs = [], [[] for _ in range(ws.layout.num_groups)]
    for plane in ws.layout.planes:
        refs[plane.group].append(
            SimpleNamespace(tensor_idx=len(tensors), page_size_bytes=plane.page_bytes)
        )
        tensors.append(SimpleNamespace(tensor=plane.view.view(torch.int8)))
    kv_caches = SimpleNamespace(tensors=tensors, group_data_refs=refs)
    spec = SimpleNamespace(
        block_ids=np.concatenate([np.asarray(b, dtype=np.int64) for b in ws.gpu_blocks]),
        group_sizes=[len(b) for b in ws.gpu_blocks],
        block_indices=[0] * len(ws.gpu_blocks),
    )
    return kv_caches, device_planes(kv_caches), spec


def host_cost(case: Case, repeats: int, deadline: float | None = None) -> HostCost:
    """Median host seconds to prepare one job of ``case`` (full size), both ways; at
    ``deadline`` each way stops after one timed call."""
    prep = job_preparation(case)
    try:
        ws = prep.workspace
        return HostCost(
            case=case.name,
            blocks=sum(len(b) for b in ws.gpu_blocks),
            planes=len(ws.layout.planes),
            descriptors=ws.job_pages,
            project_s=_median_seconds(prep.project, repeats, deadline),
            pointer_s=_median_seconds(prep.pointers, repeats, deadline),
            pointer_impl=prep.pointer_impl,
            resolve_s=_median_seconds(prep.resolve, repeats, deadline),
            pointer_path_s=_median_seconds(prep.pointer_path, repeats, deadline),
            resolve_impl=prep.resolve_impl,
        )
    finally:
        prep.close()


def _median_seconds(fn: Callable[[], object], repeats: int, deadline: float | None = None) -> float:
    fn()
    times: list[float] = []
    for _ in range(repeats):
        if times and _past(deadline):
            break
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------------- run


def new_results(config: Config) -> Results:
    """An empty :class:`Results` for ``config``: :func:`run` fills it as it goes, so a
    run cut short still holds everything finished before the cut."""
    return Results(
        environment=environment(config.device),
        config={
            "presets": config.presets,
            "sweep": config.sweep,
            "directions": config.directions,
            "repeats": config.repeats,
            "warmup": config.warmup,
            "paths": config.paths,
            "quick": config.quick,
            "target_bytes": config.target_bytes,
            "max_seconds": config.max_seconds,
        },
        measurements=[],
        host_costs=[],
        correctness=[],
        notes=[],
    )


def run(
    config: Config,
    *,
    show_progress: bool = True,
    results: Results | None = None,
    on_phase: PhaseHook = _no_phase,
) -> Results:
    """Every case on every path, then host costs and (without CUDA) the interpreter pass.

    Fills ``results`` (default: :func:`new_results`) in place: an exception (an
    interrupt) leaves every finished row in it, and ``measuring_s`` and ``wall_s``
    (``config.spent_s`` before it, plus the measuring) up to date.

    Without CUDA torch runs single-threaded: the engine's CPU path and the baselines
    copy on one thread, so the ceiling does too (and intra-op threads fighting over
    two shared cores made every figure noise).
    """
    results = new_results(config) if results is None else results
    threads = torch.get_num_threads()
    if config.device.type != "cuda":
        torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        _run(config, show_progress, results, on_phase, started)
    finally:
        torch.set_num_threads(threads)
        results.measuring_s = time.perf_counter() - started
        results.wall_s = config.spent_s + results.measuring_s
    return results


def _run(
    config: Config, show_progress: bool, results: Results, on_phase: PhaseHook, started: float
) -> None:
    timed, notes = cases_for(config)
    results.notes.extend(notes)
    notes = results.notes
    interpreted = config.device.type != "cuda"
    if interpreted:
        checked = [p for p in config.paths if p in CPU_INTERPRETED_PATHS]
        absent = [
            p
            for p in config.paths
            if p not in CPU_TIMED_PATHS + CPU_INTERPRETED_PATHS and p not in CPU_SAME_AS
        ]
        notes.extend(
            f"{alias}: without CUDA it is the {same} path, measured once as {same}"
            for alias, same in CPU_SAME_AS.items()
            if alias in config.paths
        )
        if checked:
            notes.append(
                f"not timed without CUDA: {', '.join(checked)} (interpreted Triton: "
                "byte-exact in the correctness pass, no GB/s)"
            )
        if absent:
            notes.append(f"not run without CUDA: {', '.join(absent)} (need a GPU)")
    total = len(timed) * len(_paths_for(config)) + len(config.presets)
    if interpreted:
        total += interpreted_steps(config)
    progress = Progress(total, enabled=show_progress)
    deadline = (
        None
        if config.max_seconds is None
        else started + config.max_seconds - config.spent_s - config.reserve_s
    )
    measurements = results.measurements
    done = 0
    for case in timed:
        if _past(deadline):
            break
        in_case: list[Measurement] = []
        try:
            rows = run_case(
                case, config, progress, deadline=deadline, on_phase=on_phase, finished=in_case
            )
        except BaseException:  # an interrupt: keep the paths of this case that finished
            if in_case:
                measurements.extend(in_case)
                results.cases.append(case_summary(case))
            raise
        measurements.extend(rows)
        results.cases.append(case_summary(case))
        done += 1
    skipped_paths = any(m.note == CUT_NOTE for m in measurements)
    shortened = any(m.note.startswith(CUT_SHORT_NOTE) for m in measurements)
    if done < len(timed) or skipped_paths or shortened:
        left = ", ".join(case.name for case in timed[done:]) or "none"
        notes.insert(
            0,
            f"cut: the run's {config.max_seconds:g} s budget (--max-seconds) ran out after "
            f"{done} of {len(timed)} cases; not run: {left}"
            + ("; paths marked 'cut' in a run case were not started" if skipped_paths else "")
            + (
                f"; rows noted '{CUT_SHORT_NOTE}' ran fewer timed jobs than asked"
                if shortened
                else ""
            ),
        )
    _host_costs(config, results, progress, on_phase, deadline)
    if interpreted and not _past(deadline):
        correctness_pass(
            config, progress, results=results.correctness, on_phase=on_phase, deadline=deadline
        )
        if any(m.note == CUT_NOTE for m in results.correctness):
            notes.append("cut: the interpreted correctness pass stopped (budget ran out)")
    elif interpreted:
        notes.append("cut: the interpreted correctness pass did not run (budget ran out)")


def _host_costs(
    config: Config,
    results: Results,
    progress: Progress,
    on_phase: PhaseHook,
    deadline: float | None,
) -> None:
    """The host-cost comparison of every preset started before ``deadline``."""
    notes = results.notes
    for index, name in enumerate(config.presets):
        if _past(deadline):
            left = ", ".join(config.presets[index:])
            notes.append(f"cut: host cost not measured (budget ran out): {left}")
            break
        on_phase("host-cost", name)
        try:
            repeats = max(config.repeats, 5)
            results.host_costs.append(host_cost(cases.CASES[name], repeats, deadline))
        except Exception as error:  # the project's engine failed: report it, keep the rest
            note = f"host cost (the torch engine) raised {type(error).__name__}: {error}"
            notes.append(f"FAILED: {name} {note}")
            results.correctness.append(
                Measurement(
                    case=name,
                    path="torch",
                    role="project",
                    direction="host cost",
                    status="FAILED",
                    note=note,
                )
            )
        progress.step(f"{name} host cost")


def case_summary(case: Case) -> dict[str, Any]:
    """What one job of ``case`` moves, for the report."""
    return {
        "name": case.name,
        "description": case.description,
        "job_bytes": case.job_bytes,
        "job_pages": case.job_pages,
        "page_sizes": list(case.page_sizes),
        "groups": [
            {
                "name": g.name,
                "kind": g.kind,
                "block_size": g.block_size,
                "layers": g.layers,
                "plane_bytes": list(g.plane_bytes),
                "blocks_per_job": g.blocks_per_job,
            }
            for g in case.groups
        ],
    }


__all__ = [
    "CPU_INTERPRETED_PATHS",
    "CPU_TIMED_PATHS",
    "CUT_NOTE",
    "CUT_SHORT_NOTE",
    "NOISY_ABOVE_CEILING_PCT",
    "NOISY_SPREAD",
    "Config",
    "HostCost",
    "Measurement",
    "PhaseHook",
    "Progress",
    "Results",
    "cases_for",
    "correctness_pass",
    "environment",
    "gbps",
    "host_cost",
    "job_preparation",
    "measure",
    "measure_samples",
    "new_results",
    "noise_of",
    "percent_of",
    "run",
    "run_case",
    "spread_of",
]
