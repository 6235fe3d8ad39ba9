"""``triton-offload bench``: measure the transfer paths side by side.

Without CUDA it measures what is real on a CPU (the engine's CPU path and CPU
baselines against one large copy, table-building costs) and runs the Triton kernels
under the interpreter as a labelled correctness pass. With CUDA it times every path
with CUDA events against one pinned <-> device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from triton_offload.cli.args import check_output_dir, int_at_least
from triton_offload.planner.presets import PRESETS, preset_names

DEFAULT_OUT = "bench-results"
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
        type=Path,
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
        type=int_at_least(1, "repeats"),
        default=None,
        help="timed jobs per figure, median reported (default 7 on CUDA, 9 on CPU, 3 quick)",
    )
    parser.add_argument(
        "--warmup",
        type=int_at_least(0, "warm-up count"),
        default=None,
        help="untimed jobs first (default 1-2)",
    )
    parser.add_argument(
        "--page-sizes",
        type=_sizes,
        default=None,
        help="sweep page sizes, e.g. 4k,64k,2m (default 4KiB..2MiB)",
    )
    parser.add_argument(
        "--pages",
        type=_counts,
        default=None,
        help="sweep pages per job, e.g. 16,1024,100000 (default 16..100000)",
    )
    parser.add_argument(
        "--max-seconds",
        type=int_at_least(1, "max seconds"),
        default=None,
        help=(
            "wall-clock budget: start no case or path after this many seconds, then write "
            "what was measured (the report says the run was cut); default: no limit"
        ),
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    # Before anything is measured: a run that cannot write its results wasted minutes.
    check_output_dir("--out", args.out, OUTPUT_FILES)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the first import of any @triton.jit module (the kernels are
        # imported lazily by the engine and the flat baseline).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from triton_offload.bench import cases, harness, report

    device = torch.device("cuda") if cuda else torch.device("cpu")
    if cuda:
        target = cases.QUICK_TARGET_BYTES * 8 if args.quick else None
        repeats = 3 if args.quick else 7
        warmup = 1 if args.quick else 2
        sweep_max = 400 * cases.MiB  # keeps 4 KiB x 100k pages (391 MiB) in the sweep
    else:
        target = cases.QUICK_TARGET_BYTES if args.quick else cases.CPU_TARGET_BYTES
        repeats = 3 if args.quick else 9
        warmup = 1
        sweep_max = (8 if args.quick else 64) * cases.MiB
    page_sizes = args.page_sizes or (
        [4 * cases.KiB, 64 * cases.KiB, 2 * cases.MiB]
        if args.quick
        else list(cases.SWEEP_PAGE_BYTES)
    )
    pages = args.pages or ([16, 1024] if args.quick else list(cases.SWEEP_PAGES))
    config = harness.Config(
        presets=[] if args.sweep_only else args.presets,
        sweep=args.sweep or args.sweep_only,
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
    results = harness.run(config, show_progress=not args.no_progress)
    print(report.terminal_report(results))
    written = report.write_all(results, args.out)
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    failed = [m for m in (*results.measurements, *results.correctness) if m.status == "FAILED"]
    for m in failed:
        print(f"FAILED: {m.path} on {m.case} {m.direction}: {m.note}", file=sys.stderr)
    # A project path that is not byte-exact fails the run; a failing baseline is
    # reported but does not (its optional API may differ on this machine).
    return 1 if any(m.role == "project" for m in failed) else 0


__all__ = ["DEFAULT_OUT", "OUTPUT_FILES", "PRESET_NAMES", "configure_parser", "run"]
