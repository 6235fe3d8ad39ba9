"""The Python half of ``bench/gpu_check.sh``: its verification summary.

``bench/suites/bench_seal.py``'s CUDA cases (``test_engine_verification_cost_cuda``:
paths triton, dma and auto; stores and loads; 8 and 256 KiB pages) each print one row::

    engine cuda triton store, 8 KiB pages: 24.1 GB/s unverified, 23.5 GB/s verified,
    ratio 0.98, host_cpu_s_per_GB 0.0123, algorithm ...

(on one line). :func:`verification_summary` reads gpu_check's ``gpu-tests.log`` (pytest
``-v -rA``: each case's outcome, and a passed case's printed row) and writes what the
check reports: each row's verified / unverified speed against the goal
(:data:`RATIO_GOAL`) and its host CPU seconds per verified GB, then the lowest ratio and
the median and highest CPU cost. A ratio under the goal is reported, not failed (slow is
not wrong); a passed case without its row, a row without a passed case or a row whose
numbers are not positive and finite means the report is broken, and fails the check.

Run: ``python -m triton_offload.bench.gpu_check verification GPU_TESTS_LOG`` (exit 1
when broken). Pure Python: the summary step needs neither torch nor a GPU.
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
#: How far a printed ratio (two decimals) may be from its GB/s (three decimals each):
#: the rounding of all three, with room to spare.
RATIO_TOLERANCE = 0.01
#: The CUDA cases of bench_seal.py whose rows this summary reads.
CASE = "test_engine_verification_cost_cuda"

_NUMBER = r"[-+0-9.eEinfa]+"
ROW = re.compile(
    rf"^engine cuda (?P<path>\w+) (?P<direction>store|load), (?P<page>\d+) KiB pages: "
    rf"(?P<plain>{_NUMBER}) GB/s unverified, (?P<verified>{_NUMBER}) GB/s verified, "
    rf"ratio (?P<ratio>{_NUMBER}), host_cpu_s_per_GB (?P<cpu>{_NUMBER})(?:, .*)?$"
)
OUTCOME = re.compile(rf"::{CASE}\[(?P<id>[^\]]+)\] (?P<outcome>PASSED|FAILED|ERROR|SKIPPED)\b")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] \S*bench_seal\.py:\d+: (?P<reason>.+)$")

Key = tuple[str, str, int]  # (path, direction, page KiB)


@dataclass(frozen=True)
class Row:
    """One printed row of a CUDA case."""

    path: str
    direction: str
    page_kib: int
    unverified_gbps: float
    verified_gbps: float
    printed_ratio: float  # as printed (two decimals)
    cpu_s_per_gb: float

    @property
    def ratio(self) -> float:
        """Verified / unverified speed from the printed GB/s (three decimals each: finer
        than the printed ratio, which rounds 0.949 up to the goal)."""
        if self.unverified_gbps > 0 and math.isfinite(self.unverified_gbps):
            return self.verified_gbps / self.unverified_gbps
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
            "unverified GB/s": self.unverified_gbps,
            "verified GB/s": self.verified_gbps,
            "ratio": self.printed_ratio,
            "CPU s per GB": self.cpu_s_per_gb,
        }
        bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v) or v <= 0]
        if not bad and abs(self.ratio - self.printed_ratio) > RATIO_TOLERANCE:
            bad.append(
                f"ratio {self.printed_ratio} disagrees with its GB/s "
                f"({self.verified_gbps} / {self.unverified_gbps} = {self.ratio:.4f})"
            )
        return ", ".join(bad)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_rows(log: str) -> list[Row]:
    """Every CUDA row printed in ``log``, in order."""
    rows = []
    for line in log.splitlines():
        match = ROW.match(line.strip())
        if match:
            rows.append(
                Row(
                    path=match["path"],
                    direction=match["direction"],
                    page_kib=int(match["page"]),
                    unverified_gbps=_float(match["plain"]),
                    verified_gbps=_float(match["verified"]),
                    printed_ratio=_float(match["ratio"]),
                    cpu_s_per_gb=_float(match["cpu"]),
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


def parse_outcomes(log: str) -> dict[str, str]:
    """Outcome of each CUDA case by its id (the last one named wins)."""
    return {m["id"]: m["outcome"] for m in OUTCOME.finditer(log)}


def verification_summary(log: str) -> tuple[list[str], bool]:
    """(lines to print, whether the report is broken) for gpu_check's summary."""
    head = (
        f"verification on cuda (bench_seal.py: verified / unverified speed, goal >= "
        f"{RATIO_GOAL}; host CPU s per verified GB):"
    )
    outcomes = parse_outcomes(log)
    rows = parse_rows(log)
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
            problems.append(f"case {CASE}[{case_id}] passed but printed no row")
    failed = sorted(i for i, o in outcomes.items() if o in ("FAILED", "ERROR"))
    lines = [head]
    for row in rows:
        verdict = "ok" if row.ratio >= RATIO_GOAL else "BELOW GOAL"
        lines.append(
            f"  {row.path:<6} {row.direction:<5} {row.page_kib:>4} KiB: ratio {row.ratio:.3f} "
            f"({row.verified_gbps:.2f} / {row.unverified_gbps:.2f} GB/s), host "
            f"{row.cpu_s_per_gb:.4f} CPU s per verified GB  {verdict}"
        )
    good = [r for r in rows if not r.malformed()]
    if good:
        lowest = min(good, key=lambda r: r.ratio)
        meeting = sum(r.ratio >= RATIO_GOAL for r in good)
        lines.append(
            f"  ratio: lowest {lowest.ratio:.3f} ({lowest.name}), median "
            f"{statistics.median(r.ratio for r in good):.3f}; {meeting} of {len(good)} rows "
            f"meet the goal"
        )
        costliest = max(good, key=lambda r: r.cpu_s_per_gb)
        lines.append(
            f"  host CPU s per verified GB: median "
            f"{statistics.median(r.cpu_s_per_gb for r in good):.4f}, highest "
            f"{costliest.cpu_s_per_gb:.4f} ({costliest.name})"
        )
    if failed:
        lines.append(f"  failed cases (the test file fails the check): {', '.join(failed)}")
    for problem in problems:
        lines.append(f"  REPORT BROKEN: {problem}")
    return lines, bool(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_offload.bench.gpu_check")
    commands = parser.add_subparsers(dest="command", required=True)
    verification = commands.add_parser("verification", help="summarise bench_seal's CUDA rows")
    verification.add_argument("log", type=Path, help="gpu_check's gpu-tests.log")
    args = parser.parse_args(argv)
    try:
        text = args.log.read_text(errors="replace")
    except OSError as error:
        print(f"verification on cuda: REPORT BROKEN: cannot read {args.log}: {error}")
        return 1
    lines, broken = verification_summary(text)
    print("\n".join(lines))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "RATIO_GOAL",
    "Row",
    "case_key",
    "main",
    "parse_outcomes",
    "parse_rows",
    "verification_summary",
]
