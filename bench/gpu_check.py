"""The Python half of ``bench/gpu_check.sh``: its summary of bench_seal.py's CUDA rows.

``bench/suites/bench_seal.py``'s CUDA cases (paths triton, dma and auto; stores and
loads; 8 and 256 KiB pages) each print one row (on one line), of two kinds:

- ``test_engine_verification_cost_cuda``: verified jobs against unverified ones::

    engine cuda triton store, 8 KiB pages: 24.1 GB/s unverified, 23.5 GB/s verified,
    ratio 0.98, host_cpu_s_per_GB 0.0123, algorithm ...

- ``test_engine_keyed_cost_cuda``: verified jobs with a seal key against verified jobs
  without one::

    engine cuda triton store keyed, 8 KiB pages: 24.1 GB/s unkeyed, 23.5 GB/s keyed,
    ratio 0.98, algorithm ...

:func:`verification_summary` and :func:`keyed_summary` read gpu_check's
``gpu-tests.log`` (pytest ``-v -rA``: each case's outcome, and a passed case's printed
row) and write one section each of what the check reports: each row's measured / base
speed against its goal (:data:`RATIO_GOAL`: verified / unverified;
:data:`KEYED_RATIO_GOAL`: keyed / unkeyed) and, for verification, its host CPU seconds per
verified GB; then the lowest ratio (and for verification the median and highest CPU
cost). A ratio under the goal is reported, not failed (slow is not wrong); a passed case
without its row, a row without a passed case or a row whose numbers are not positive and
finite means the report is broken, and fails the check. Both sections are one parser
(:func:`summary`) run with each kind's case name, row pattern and goal (:class:`RowKind`).

Run: ``python -m triton_offload.bench.gpu_check verification GPU_TESTS_LOG`` (both
sections; exit 1 when either is broken). Pure Python: the summary step needs neither
torch nor a GPU.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

#: The goal for verified / unverified speed on CUDA: checksums computed in the copy's
#: own pass should cost at most 5%.
RATIO_GOAL = 0.95
#: The goal for keyed / unkeyed verified speed on CUDA: a seal key (keyed universal
#: hashes) should cost verified jobs at most 10%.
KEYED_RATIO_GOAL = 0.9
#: How far a printed ratio (two decimals) may be from its GB/s (three decimals each):
#: the rounding of all three, with room to spare.
RATIO_TOLERANCE = 0.01
#: The CUDA cases of bench_seal.py whose verification rows this summary reads.
CASE = "test_engine_verification_cost_cuda"
#: The CUDA cases of bench_seal.py whose keyed rows this summary reads.
KEYED_CASE = "test_engine_keyed_cost_cuda"

_NUMBER = r"[-+0-9.eEinfa]+"
# The two row patterns exclude each other: a verification row has ", " right after its
# direction, a keyed row " keyed, " (tests/bench/test_gpu_check.py holds both to it).
ROW = re.compile(
    rf"^engine cuda (?P<path>\w+) (?P<direction>store|load), (?P<page>\d+) KiB pages: "
    rf"(?P<plain>{_NUMBER}) GB/s unverified, (?P<verified>{_NUMBER}) GB/s verified, "
    rf"ratio (?P<ratio>{_NUMBER}), host_cpu_s_per_GB (?P<cpu>{_NUMBER})(?:, .*)?$"
)
KEYED_ROW = re.compile(
    rf"^engine cuda (?P<path>\w+) (?P<direction>store|load) keyed, (?P<page>\d+) KiB pages: "
    rf"(?P<plain>{_NUMBER}) GB/s unkeyed, (?P<verified>{_NUMBER}) GB/s keyed, "
    rf"ratio (?P<ratio>{_NUMBER})(?:, .*)?$"
)
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] \S*bench_seal\.py:\d+: (?P<reason>.+)$")

Key = tuple[str, str, int]  # (path, direction, page KiB)


def _outcome_pattern(case: str) -> re.Pattern[str]:
    """``::CASE[id] OUTCOME`` as pytest -v names each case (not -rA's summary lines,
    which put the outcome first)."""
    return re.compile(
        rf"::{re.escape(case)}\[(?P<id>[^\]]+)\] (?P<outcome>PASSED|FAILED|ERROR|SKIPPED)\b"
    )


OUTCOME = _outcome_pattern(CASE)


@dataclass(frozen=True)
class RowKind:
    """One kind of CUDA row of bench_seal.py: which cases print it, how it reads, and the
    goal its ratio (``measured`` speed / ``base`` speed) is judged against."""

    case: str  # the test function whose parametrised cases print these rows
    row: re.Pattern[str]  # groups path, direction, page, plain, verified, ratio[, cpu]
    goal: float
    base: str  # what the row calls the base speed ("unverified", "unkeyed")
    measured: str  # ... and the measured one ("verified", "keyed")
    head: str  # the section's first line, up to its colon
    cpu: bool  # whether rows print host_cpu_s_per_GB (the pattern has a cpu group)

    @property
    def outcome(self) -> re.Pattern[str]:
        return _outcome_pattern(self.case)


VERIFICATION = RowKind(
    case=CASE,
    row=ROW,
    goal=RATIO_GOAL,
    base="unverified",
    measured="verified",
    head=(
        f"verification on cuda (bench_seal.py: verified / unverified speed, goal >= "
        f"{RATIO_GOAL}; host CPU s per verified GB):"
    ),
    cpu=True,
)
KEYED = RowKind(
    case=KEYED_CASE,
    row=KEYED_ROW,
    goal=KEYED_RATIO_GOAL,
    base="unkeyed",
    measured="keyed",
    head=(
        f"keyed seals on cuda (bench_seal.py: keyed / unkeyed verified speed, goal >= "
        f"{KEYED_RATIO_GOAL}):"
    ),
    cpu=False,
)


@dataclass(frozen=True)
class Row:
    """One printed row of a CUDA case."""

    kind: RowKind
    path: str
    direction: str
    page_kib: int
    base_gbps: float  # unverified (verification rows) or unkeyed (keyed rows) GB/s
    measured_gbps: float  # verified or keyed GB/s
    printed_ratio: float  # as printed (two decimals)
    cpu_s_per_gb: float | None  # None exactly when the kind prints none

    @property
    def ratio(self) -> float:
        """Measured / base speed from the printed GB/s (three decimals each: finer than
        the printed ratio, which rounds 0.949 up to 0.95)."""
        if self.base_gbps > 0 and math.isfinite(self.base_gbps):
            return self.measured_gbps / self.base_gbps
        return math.nan

    @property
    def key(self) -> Key:
        return (self.path, self.direction, self.page_kib)

    @property
    def name(self) -> str:
        return f"{self.path} {self.direction} {self.page_kib} KiB"

    def malformed(self) -> str:
        """What is wrong with the numbers ('' when they are positive and finite)."""
        values = {
            f"{self.kind.base} GB/s": self.base_gbps,
            f"{self.kind.measured} GB/s": self.measured_gbps,
            "ratio": self.printed_ratio,
        }
        if self.cpu_s_per_gb is not None:
            values["CPU s per GB"] = self.cpu_s_per_gb
        bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v) or v <= 0]
        if not bad and abs(self.ratio - self.printed_ratio) > RATIO_TOLERANCE:
            bad.append(
                f"ratio {self.printed_ratio} disagrees with its GB/s "
                f"({self.measured_gbps} / {self.base_gbps} = {self.ratio:.4f})"
            )
        return ", ".join(bad)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_rows(log: str, kind: RowKind = VERIFICATION) -> list[Row]:
    """Every CUDA row of ``kind`` printed in ``log``, in order."""
    rows = []
    for line in log.splitlines():
        match = kind.row.match(line.strip())
        if match:
            rows.append(
                Row(
                    kind=kind,
                    path=match["path"],
                    direction=match["direction"],
                    page_kib=int(match["page"]),
                    base_gbps=_float(match["plain"]),
                    measured_gbps=_float(match["verified"]),
                    printed_ratio=_float(match["ratio"]),
                    cpu_s_per_gb=_float(match["cpu"]) if kind.cpu else None,
                )
            )
    return rows


def case_key(case_id: str) -> Key | None:
    """``store-8KiB-triton`` (any order of the three parts) -> ``("triton", "store", 8)``."""
    parts = case_id.split("-")
    direction = [p for p in parts if p in ("store", "load")]
    page = [int(p[:-3]) for p in parts if re.fullmatch(r"\d+KiB", p)]
    rest = [p for p in parts if p not in direction and not re.fullmatch(r"\d+KiB", p)]
    if len(direction) != 1 or len(page) != 1 or len(rest) != 1:
        return None
    return (rest[0], direction[0], page[0])


def parse_outcomes(log: str, kind: RowKind = VERIFICATION) -> dict[str, str]:
    """Outcome of each CUDA case of ``kind`` by its id (the last one named wins)."""
    return {m["id"]: m["outcome"] for m in kind.outcome.finditer(log)}


def _row_line(row: Row) -> str:
    verdict = "ok" if row.ratio >= row.kind.goal else "BELOW GOAL"
    host = (
        f", host {row.cpu_s_per_gb:.4f} CPU s per verified GB"
        if row.cpu_s_per_gb is not None
        else ""
    )
    return (
        f"  {row.path:<6} {row.direction:<5} {row.page_kib:>4} KiB: ratio {row.ratio:.3f} "
        f"({row.measured_gbps:.2f} / {row.base_gbps:.2f} GB/s){host}  {verdict}"
    )


def summary(log: str, kind: RowKind) -> tuple[list[str], bool]:
    """(lines to print, whether the report is broken) of ``kind``'s section of
    gpu_check's summary."""
    head = kind.head
    outcomes = parse_outcomes(log, kind)
    rows = parse_rows(log, kind)
    if not outcomes and not rows:
        return [f"{head} not measured: its CUDA cases did not run"], False
    problems: list[str] = []
    passed: dict[Key, str] = {}
    for case_id, outcome in outcomes.items():
        key = case_key(case_id)
        if key is None:
            problems.append(f"case id {case_id!r} names no path, direction and page size")
        elif outcome == "PASSED":
            passed[key] = case_id
    if outcomes and all(o == "SKIPPED" for o in outcomes.values()) and not rows:
        # pytest -rA folds skips by location and reason, not by case: the reasons given
        # for any of bench_seal.py's skips (under -m cuda: its CUDA cases only).
        reasons = sorted({m["reason"] for m in map(SKIP_REASON.match, log.splitlines()) if m})
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return [f"{head} not measured: its CUDA cases skipped{why}"], False
    by_key: dict[Key, Row] = {}
    for row in rows:
        if row.key in by_key:
            problems.append(f"row {row.name} printed twice")
        by_key[row.key] = row
        bad = row.malformed()
        if bad:
            problems.append(f"row {row.name}: {bad}")
        if row.key not in passed:
            problems.append(f"row {row.name} has no passed case")
    for key, case_id in sorted(passed.items()):
        if key not in by_key:
            problems.append(f"case {kind.case}[{case_id}] passed but printed no row")
    failed = sorted(i for i, o in outcomes.items() if o in ("FAILED", "ERROR"))
    lines = [head, *map(_row_line, rows)]
    # The totals count only rows whose numbers are sound (a malformed one is a problem).
    good = [r for r in rows if not r.malformed()]
    if good:
        lowest = min(good, key=lambda r: r.ratio)
        meeting = sum(r.ratio >= kind.goal for r in good)
        lines.append(
            f"  ratio: lowest {lowest.ratio:.3f} ({lowest.name}), median "
            f"{statistics.median(r.ratio for r in good):.3f}; {meeting} of {len(good)} rows "
            f"meet the goal"
        )
        costs = [(r.cpu_s_per_gb, r) for r in good if r.cpu_s_per_gb is not None]
        if costs:
            highest, costliest = max(costs, key=lambda c: c[0])
            lines.append(
                f"  host CPU s per verified GB: median "
                f"{statistics.median(c for c, _ in costs):.4f}, highest "
                f"{highest:.4f} ({costliest.name})"
            )
    if failed:
        lines.append(f"  failed cases (the test file fails the check): {', '.join(failed)}")
    for problem in problems:
        lines.append(f"  REPORT BROKEN: {problem}")
    return lines, bool(problems)


def verification_summary(log: str) -> tuple[list[str], bool]:
    """(lines to print, whether the report is broken) of the verification section."""
    return summary(log, VERIFICATION)


def keyed_summary(log: str) -> tuple[list[str], bool]:
    """(lines to print, whether the report is broken) of the keyed seals section."""
    return summary(log, KEYED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_offload.bench.gpu_check")
    commands = parser.add_subparsers(dest="command", required=True)
    verification = commands.add_parser(
        "verification", help="summarise bench_seal's CUDA rows (verification, keyed seals)"
    )
    verification.add_argument("log", type=Path, help="gpu_check's gpu-tests.log")
    args = parser.parse_args(argv)
    try:
        text = args.log.read_text(errors="replace")
    except OSError as error:
        print(f"verification on cuda: REPORT BROKEN: cannot read {args.log}: {error}")
        return 1
    # Both sections always print (each says "not measured" when its cases did not run);
    # either one broken fails the check.
    broken = False
    for kind in (VERIFICATION, KEYED):
        lines, kind_broken = summary(text, kind)
        print("\n".join(lines))
        broken |= kind_broken
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "KEYED",
    "KEYED_RATIO_GOAL",
    "RATIO_GOAL",
    "VERIFICATION",
    "Row",
    "RowKind",
    "case_key",
    "keyed_summary",
    "main",
    "parse_outcomes",
    "parse_rows",
    "summary",
    "verification_summary",
]
