"""``triton-offload bench``: measure the transfer paths side by side.

Without CUDA it measures what is real on a CPU (the engine's CPU path and CPU
baselines against one large copy, table-building costs) and runs the Triton kernels
under the interpreter as a labelled correctness pass. With CUDA it times every path
with CUDA events against one pinned <-> device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from triton_offload.cli import CLI_IMPORTED_AT
from triton_offload.cli.args import (
    UsageError,
    check_output_dir,
    folder,
    format_bytes,
    int_at_least,
    int_between,
)
from triton_offload.cli.interrupt import (
    Interrupted,
    PhaseTracker,
    ignore_further,
    interrupts_raise,
)
from triton_offload.planner.presets import PRESETS, preset_names

DEFAULT_OUT = "bench-results"

# Upper bounds of the numeric flags. Time: a default CPU run (9 repeats, 1 warm-up job)
# took about 40 s on the 2-core machine this is developed on, most of it timed jobs, so
# each repeat of every path on every case costs a few seconds; 1,000 repeats is hours,
# and a larger count is a typo, not a measurement plan.
MAX_REPEATS = 1000
MAX_WARMUP = 100
#: Time: a budget over one day bounds nothing a person waits for.
MAX_BUDGET_SECONDS = 86_400
#: Largest job of one sweep point (memory): without CUDA the caches and the pool hold
#: the job twice in host memory next to other users' jobs; on CUDA 4 KiB x 100k pages
#: (391 MiB) must fit. Points over it are skipped, so a flag asking only for such points
#: is refused before the run instead of running the whole bench for nothing.
SWEEP_MAX_BYTES_CUDA = 400 << 20
SWEEP_MAX_BYTES_CPU = 64 << 20
SWEEP_MAX_BYTES_QUICK = 8 << 20
#: Seconds of ``--max-seconds`` kept for writing the report and the plots once the
#: measuring stops: report.md, results.json and two plots took 1.3-2.4 s (importing
#: matplotlib included) on a loaded 2-core machine.
REPORT_RESERVE_SECONDS = 3.0
#: Longest gap between the process's creation and the CLI's import that is still this
#: program's own start-up (the interpreter, site, the CLI's imports): 0.09-0.12 s on a
#: loaded 2-core machine; the rest is room for heavier load or a cold file cache. A longer
#: gap is another program that ran first in the same process (a shell that exec'd this
#: command after `pip install ... &&`): its time is not the command's.
STARTUP_ALLOWANCE_S = 2.0
#: What a run writes into ``--out`` (the report module's names; listed here so that
#: checking the folder before the run imports no torch).
OUTPUT_FILES = ("results.json", "report.md", "bandwidth.png", "sweep.png")

# Names come from the package's torch-free preset table (not from the harness) so that
# building the CLI's parser imports no torch: `triton-offload --help` stays instant.
PRESET_NAMES = tuple(preset_names("bench"))
DIRECTION_NAMES = ("store", "load")
PATH_NAMES = (
    "triton",
    "dma",
    "auto",
    "torch",
    "per-page-copy",
    "index-copy",
    "flat-triton",
    "batched-dma",
    "vllm-swap-blocks",
)


def _choices(kind: str, allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of ``allowed`` (``all`` = every one)."""

    def parse(text: str) -> list[str]:
        if text.strip() == "all":
            return list(allowed)
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"empty {kind} list {text!r}")
        for value in values:
            if value not in allowed:
                other = PRESETS.get(value) if kind == "preset" else None
                where = f" (a preset of {', '.join(other.commands)} only)" if other else ""
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {value!r}{where}; choose from {', '.join(allowed)} (or 'all')"
                )
        return list(dict.fromkeys(values))

    parse.__name__ = kind
    return parse


def _sizes(text: str) -> list[int]:
    from triton_offload.bench.cases import parse_size

    try:
        return [parse_size(v) for v in text.split(",") if v.strip()] or _empty(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _counts(text: str) -> list[int]:
    parse = int_at_least(1, "pages per job")
    return [parse(v.strip()) for v in text.split(",") if v.strip()] or _empty(text)


def _empty(text: str) -> list[int]:
    raise argparse.ArgumentTypeError(f"empty list {text!r}")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=folder,
        default=Path(DEFAULT_OUT),
        help="output folder for results.json, report.md and the plots bandwidth.png (and "
        f"sweep.png with --sweep); created if missing (default: {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small cases and few repeats (CI smoke run)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="add the raw sweep: page size x pages per job x direction",
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="the raw sweep without the model presets (gpu_check's last step: the presets "
        "were measured by the step before)",
    )
    parser.add_argument(
        "--presets",
        type=_choices("preset", PRESET_NAMES),
        default=list(PRESET_NAMES),
        help="comma-separated model presets (default all; the same names as plan): "
        + "; ".join(f"{name}: {PRESETS[name].description}" for name in PRESET_NAMES),
    )
    parser.add_argument(
        "--directions",
        type=_choices("direction", DIRECTION_NAMES),
        default=list(DIRECTION_NAMES),
        help="store (device -> pool), load (pool -> device), or both (default)",
    )
    parser.add_argument(
        "--paths",
        type=_choices("path", PATH_NAMES),
        default=list(PATH_NAMES),
        help=(
            "comma-separated paths (default all; the ceiling is always measured): "
            + ", ".join(PATH_NAMES)
        ),
    )
    parser.add_argument(
        "--repeats",
        type=int_between(
            1,
            MAX_REPEATS,
            "repeats",
            "time: each repeat is one more timed job of every path on every case",
        ),
        default=None,
        help="timed jobs per figure, median reported (default 7 on CUDA, 9 on CPU, 3 quick)",
    )
    parser.add_argument(
        "--warmup",
        type=int_between(
            0, MAX_WARMUP, "warm-up count", "time: untimed jobs of every path on every case"
        ),
        default=None,
        help="untimed jobs first (default 1-2)",
    )
    parser.add_argument(
        "--page-sizes",
        type=_sizes,
        default=None,
        help="sweep page sizes, e.g. 4k,64k,2m (default 4KiB..2MiB); needs --sweep",
    )
    parser.add_argument(
        "--pages",
        type=_counts,
        default=None,
        help="sweep pages per job, e.g. 16,1024,100000 (default 16..100000); needs --sweep",
    )
    parser.add_argument(
        "--max-seconds",
        type=int_between(1, MAX_BUDGET_SECONDS, "max seconds", "time: one day"),
        default=None,
        help=(
            "wall-clock budget of the whole command (start-up and report included): no case "
            "or path starts after it, timed jobs stop at it (a path keeps the jobs it ran), "
            "then what was measured is written (the report says what was cut); default: "
            "no limit"
        ),
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


#: What the interrupt message and the progress lines call each phase.
PHASES = {
    "start-up": "start-up (importing torch and triton)",
    "cases": "the timed cases",
    "sweep": "the raw sweep",
    "host-cost": "the host-cost comparison",
    "interpreted": "the interpreted Triton correctness pass",
    "report": "writing the report and plots",
}


def _check_dependent_flags(args: argparse.Namespace) -> None:
    """Flags that do nothing without ``--sweep`` (or ``--sweep-only``) are refused, not
    silently ignored."""
    if args.sweep or args.sweep_only:
        return
    for flag, value in (("--page-sizes", args.page_sizes), ("--pages", args.pages)):
        if value is not None:
            shown = ",".join(str(v) for v in value)
            raise UsageError(f"{flag} {shown}: only the raw sweep uses it; add --sweep")


def _check_sweep_sizes(
    page_sizes: Sequence[int],
    pages: Sequence[int],
    max_bytes: int,
    where: str,
    *,
    given: tuple[bool, bool],
) -> None:
    """Refuse a page size or a page count that only makes sweep points over
    ``max_bytes`` (the harness would skip every one of them after the whole bench ran).

    ``given``: whether the user gave (``--page-sizes``, ``--pages``); only given values
    are judged (a default point over the limit is skipped with a note, as before)."""
    why = f"(memory: at most {format_bytes(max_bytes)} per sweep job {where})"
    smallest_pages, smallest_page = min(pages), min(page_sizes)

    def check_sizes() -> None:
        for size in page_sizes:
            if size * smallest_pages > max_bytes:
                raise UsageError(
                    f"--page-sizes {size}: a job of {smallest_pages:,} pages of "
                    f"{format_bytes(size)} is {format_bytes(size * smallest_pages)}; page "
                    f"size must be <= {format_bytes(max_bytes // smallest_pages)} {why}"
                )

    def check_pages() -> None:
        for count in pages:
            if count * smallest_page > max_bytes:
                raise UsageError(
                    f"--pages {count}: a job of {count:,} pages of "
                    f"{format_bytes(smallest_page)} is {format_bytes(count * smallest_page)}; "
                    f"pages per job must be <= {max_bytes // smallest_page:,} {why}"
                )

    if given[1]:
        check_pages()
    if given[0]:
        check_sizes()


def _process_age_s() -> float | None:
    """Seconds since this process was created (Linux /proc), None where unknown."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # Field 22 of stat, the start in clock ticks since boot; the fields after the
        # command name (in parentheses, which may hold spaces) start at field 3.
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return max(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _command_start() -> tuple[float, str]:
    """The ``time.perf_counter()`` value at which this command started, and what that is
    (:func:`command_start` on this process's clock and age)."""
    now = time.perf_counter()
    program = Path(sys.argv[0] if sys.argv else "")
    runs_this = program.name == "triton-offload" or program.parent.name == "triton_offload"
    age = _process_age_s() if runs_this and "bench" in sys.argv[1:] else None
    return command_start(now, age, CLI_IMPORTED_AT)


def command_start(now: float, process_age_s: float | None, imported_at: float) -> tuple[float, str]:
    """Where the command's wall time starts, on the clock of ``now``, and its label.

    The process's start when the process is this command (`triton-offload bench`,
    `python -m triton_offload bench`: the interpreter's start-up and imports count). An
    exec keeps the process's start: `bash -c "pip install ... && triton-offload bench"`
    runs the command in the shell's process, created before pip ran. So where the process
    was older at the CLI's import (``imported_at``) than start-up takes
    (``STARTUP_ALLOWANCE_S``), the command starts at that import; the interpreter's
    start-up before it cannot be seen after an exec and is left out. Age unknown (a
    caller's process, or no /proc): ``now``."""
    if process_age_s is None:
        return now, "the command's entry"
    process_start = now - process_age_s
    before_import = imported_at - process_start
    if before_import <= STARTUP_ALLOWANCE_S:
        return process_start, "the process's start"
    return imported_at, (
        f"the import of triton_offload.cli, {before_import:.1f} s into a process that ran "
        "another program first"
    )


def run(args: argparse.Namespace) -> int:
    started, wall_from = _command_start()
    # Before anything is measured: a run that cannot write its results wasted minutes.
    _check_dependent_flags(args)
    check_output_dir("--out", args.out, OUTPUT_FILES)
    tracker = PhaseTracker("bench", progress=not args.no_progress, labels=PHASES)
    results = None
    with interrupts_raise(), tracker.heartbeat():
        try:
            config = _configure(args, tracker)
            from triton_offload.bench import harness

            results = harness.new_results(config)
            results.wall_from = wall_from
            # The budget is the command's: start-up is spent, the report's time is kept.
            config.spent_s = time.perf_counter() - started
            config.reserve_s = REPORT_RESERVE_SECONDS
            harness.run(
                config, show_progress=not args.no_progress, results=results, on_phase=tracker.enter
            )
            tracker.enter("report")
            from triton_offload.bench import report

            results.wall_s = time.perf_counter() - started  # what results.json can hold
            written = report.write_all(results, args.out)
            results.wall_s = time.perf_counter() - started  # and the report's writing
            text = report.terminal_report(results)
        except (Interrupted, KeyboardInterrupt) as stop:
            # A KeyboardInterrupt raised by other code (Python's own SIGINT handler
            # before ours was installed) is the same Ctrl-C.
            signum = stop.signum if isinstance(stop, Interrupted) else int(signal.SIGINT)
            if results is not None:
                results.wall_s = time.perf_counter() - started
            return _interrupted(Interrupted(signum), tracker, results, args.out)
    print(text)
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    failed = [m for m in (*results.measurements, *results.correctness) if m.status == "FAILED"]
    for m in failed:
        print(f"FAILED: {m.path} on {m.case} {m.direction}: {m.note}", file=sys.stderr)
    # A project path that is not byte-exact fails the run; a failing baseline is
    # reported but does not (its optional API may differ on this machine).
    return 1 if any(m.role == "project" for m in failed) else 0


def _interrupted(stop: Interrupted, tracker: PhaseTracker, results: object, out: Path) -> int:
    """Write what an interrupted run has to the partial files; one line on stderr."""
    ignore_further()  # also after a KeyboardInterrupt that bypassed our handler
    where = tracker.where()
    if results is None:
        print(
            f"triton-offload bench: interrupted by {stop.name} during {where}: nothing was "
            "measured, nothing written",
            file=sys.stderr,
        )
        return stop.exit_status
    from triton_offload.bench import report
    from triton_offload.bench.harness import Results

    assert isinstance(results, Results)
    message = f"interrupted by {stop.name} during {where}"
    results.partial = {
        "signal": stop.name,
        "phase": tracker.phase,
        "where": where,
        "message": message,
    }
    left = (
        "every row was measured; the complete report and plots were not written"
        if tracker.phase == "report"
        else "rows after that point were not measured"
    )
    results.notes.insert(0, f"cut: {message}; {left}")
    paths = report.write_partial(results, out)
    counted = f"{len(results.measurements)} timed rows, {len(results.correctness)} checks"
    print(
        f"triton-offload bench: {message}; partial results ({counted}) in "
        + " and ".join(str(p) for p in paths),
        file=sys.stderr,
    )
    return stop.exit_status


def _configure(args: argparse.Namespace, tracker: PhaseTracker) -> Any:
    """The harness ``Config`` of a run: imports torch (start-up), picks the defaults of
    this machine and refuses sweep sizes it cannot run, before anything is measured."""
    tracker.enter("start-up")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the first import of any @triton.jit module (the kernels are
        # imported lazily by the engine and the flat baseline).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from triton_offload.bench import cases, harness

    device = torch.device("cuda") if cuda else torch.device("cpu")
    if cuda:
        target = cases.QUICK_TARGET_BYTES * 8 if args.quick else None
        repeats = 3 if args.quick else 7
        warmup = 1 if args.quick else 2
        sweep_max, where = SWEEP_MAX_BYTES_CUDA, "on CUDA"
    else:
        target = cases.QUICK_TARGET_BYTES if args.quick else cases.CPU_TARGET_BYTES
        repeats = 3 if args.quick else 9
        warmup = 1
        sweep_max, where = (
            (SWEEP_MAX_BYTES_QUICK, "of a --quick run without CUDA")
            if args.quick
            else (SWEEP_MAX_BYTES_CPU, "without CUDA")
        )
    page_sizes = args.page_sizes or (
        [4 * cases.KiB, 64 * cases.KiB, 2 * cases.MiB]
        if args.quick
        else list(cases.SWEEP_PAGE_BYTES)
    )
    pages = args.pages or ([16, 1024] if args.quick else list(cases.SWEEP_PAGES))
    sweeping = args.sweep or args.sweep_only
    if sweeping:
        given = (args.page_sizes is not None, args.pages is not None)
        _check_sweep_sizes(page_sizes, pages, sweep_max, where, given=given)
    return harness.Config(
        presets=[] if args.sweep_only else args.presets,
        sweep=sweeping,
        directions=args.directions,
        repeats=args.repeats or repeats,
        warmup=warmup if args.warmup is None else args.warmup,
        paths=args.paths,
        quick=args.quick,
        device=device,
        target_bytes=target,
        sweep_page_bytes=page_sizes,
        sweep_pages=pages,
        sweep_max_bytes=sweep_max,
        max_seconds=args.max_seconds,
    )


__all__ = [
    "DEFAULT_OUT",
    "MAX_BUDGET_SECONDS",
    "MAX_REPEATS",
    "MAX_WARMUP",
    "OUTPUT_FILES",
    "PHASES",
    "PRESET_NAMES",
    "REPORT_RESERVE_SECONDS",
    "STARTUP_ALLOWANCE_S",
    "configure_parser",
    "run",
]
