"""SIGINT/SIGTERM in every phase of ``bench`` (with and without ``--sweep``) and ``verify``.

Each test runs the real command in a subprocess. The signal is sent at a known point,
not after a sleep: ``TRITON_OFFLOAD_SIGNAL_AT=PHASE@N`` makes the command signal itself
when it enters ``PHASE`` for the ``N``-th time (one test sends the signal from outside,
once the command has said on stderr that the phase started). Each checks: exit 130
(143 for SIGTERM), exactly one line about the interrupt and no traceback, a partial
file marked partial that names the phase, and an earlier complete report in the same
folder left byte for byte as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from triton_offload.cli.interrupt import SIGNAL_AT_ENV

# The smallest bench that still passes every phase: one preset, the CPU path and the
# interpreted kernel, one direction, one repeat, one sweep point.
BENCH = [
    "bench",
    "--quick",
    "--presets",
    "llama3.1-8b-tp4",
    "--paths",
    "torch,triton",
    "--directions",
    "store",
    "--repeats",
    "1",
    "--warmup",
    "0",
]
SWEEP = ["--sweep", "--page-sizes", "4k", "--pages", "16"]
VERIFY = ["verify", "--preset", "mamba-tiny", "--dcp", "1", "--blocks-per-chunk", "1"]
BENCH_FILES = ("results.json", "report.md", "bandwidth.png", "sweep.png")


def _env(signal_at: str | None) -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(SIGNAL_AT_ENV, None)
    if signal_at is not None:
        env[SIGNAL_AT_ENV] = signal_at
    return env


def _cli(argv: list[str], signal_at: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "triton_offload", *argv],
        capture_output=True,
        text=True,
        env=_env(signal_at),
        check=False,
    )


@pytest.fixture(scope="module")
def complete_bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete bench report (with the sweep plot), written once for the module."""
    out = tmp_path_factory.mktemp("complete") / "bench"
    done = _cli([*BENCH, *SWEEP, "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(BENCH_FILES)
    return out


@pytest.fixture(scope="module")
def complete_verify(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("complete") / "verify"
    done = _cli([*VERIFY, "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "verify.json").read_text())["partial"] is None
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _one_interrupt_line(done: subprocess.CompletedProcess[str], command: str, signame: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "interrupted by" in line]
    assert len(lines) == 1, done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1] == lines[0]  # and it is the last line
    assert lines[0].startswith(f"triton-offload {command}: interrupted by {signame} during ")
    return lines[0]


@pytest.mark.parametrize(
    ("signal_at", "phase", "sweep"),
    [
        ("cases@2", "cases", False),  # after the ceiling, as the torch path starts
        ("sweep@2", "sweep", True),
        ("host-cost@1", "host-cost", False),
        ("interpreted@1", "interpreted", False),
        ("report@1", "report", True),  # while the plots are drawn
    ],
)
def test_bench_interrupted_in_a_phase_keeps_what_it_measured(
    signal_at: str, phase: str, sweep: bool, complete_bench: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    shutil.copytree(complete_bench, out)
    before = _snapshot(out)
    done = _cli([*BENCH, *(SWEEP if sweep else []), "--out", str(out)], signal_at)
    assert done.returncode == 130, done.stderr
    line = _one_interrupt_line(done, "bench", "SIGINT")
    assert "results.partial.json" in line and "report.partial.md" in line
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # byte for byte
    assert set(after) - set(before) == {"results.partial.json", "report.partial.md"}
    payload = json.loads(after["results.partial.json"])
    assert payload["partial"]["signal"] == "SIGINT"
    assert payload["partial"]["phase"] == phase
    assert payload["notes"][0].startswith("cut: interrupted by SIGINT during ")
    assert after["report.partial.md"].decode().startswith("# triton-offload bench report (partial)")
    # Everything finished before the cut is kept: in the cut case, the ceiling's
    # first pass; after it, every timed path.
    if phase == "cases":
        assert [m["path"] for m in payload["measurements"]] == ["ceiling"]
    else:
        assert any(m["path"] == "torch" for m in payload["measurements"])
    if phase in ("interpreted", "report"):
        assert payload["host_costs"]
    if phase == "report":
        assert payload["correctness"] and payload["correctness"][0]["status"] == "verified"


def test_bench_sigterm_exits_143(complete_bench: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    shutil.copytree(complete_bench, out)
    before = _snapshot(out)
    done = _cli([*BENCH, "--out", str(out)], "interpreted@1/SIGTERM")
    assert done.returncode == 143, done.stderr
    _one_interrupt_line(done, "bench", "SIGTERM")
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before
    assert json.loads(after["results.partial.json"])["partial"]["signal"] == "SIGTERM"


def test_bench_interrupted_at_start_up_writes_nothing(tmp_path: Path) -> None:
    done = _cli([*BENCH, "--out", str(tmp_path / "bench")], "start-up@1")
    assert done.returncode == 130, done.stderr
    line = _one_interrupt_line(done, "bench", "SIGINT")
    assert line.endswith("nothing was measured, nothing written")
    assert not list((tmp_path / "bench").iterdir())


def test_bench_interrupted_from_outside(complete_bench: Path, tmp_path: Path) -> None:
    """A real Ctrl-C from another process, sent once the interpreted pass started."""
    out = tmp_path / "bench"
    shutil.copytree(complete_bench, out)
    before = _snapshot(out)
    process = subprocess.Popen(
        [sys.executable, "-m", "triton_offload", *BENCH, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(None),
    )
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "interpreted Triton correctness pass" in line:
            process.send_signal(signal.SIGINT)
            break
    rest = process.stderr.read()
    process.wait()
    done = subprocess.CompletedProcess(process.args, process.returncode, "", "".join(seen) + rest)
    assert process.returncode == 130, done.stderr
    _one_interrupt_line(done, "bench", "SIGINT")
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before
    assert json.loads(after["results.partial.json"])["partial"]["signal"] == "SIGINT"


@pytest.mark.parametrize(
    ("signal_at", "finished"),
    [("start-up@1", 0), ("scenarios@3", 2), ("report@1", 8)],
)  # start-up: cut before the scenarios were built
def test_verify_interrupted_in_a_phase_keeps_what_it_ran(
    signal_at: str, finished: int, complete_verify: Path, tmp_path: Path
) -> None:
    out = tmp_path / "verify"
    shutil.copytree(complete_verify, out)
    before = _snapshot(out)
    done = _cli([*VERIFY, "--out", str(out)], signal_at)
    assert done.returncode == 130, done.stderr
    line = _one_interrupt_line(done, "verify", "SIGINT")
    assert (f"{finished} of 8 scenarios finished" if finished else "no scenario ran") in line
    after = _snapshot(out)
    assert after["verify.json"] == before["verify.json"]
    payload = json.loads(after["verify.partial.json"])
    assert payload["partial"]["phase"] == signal_at.split("@")[0]
    assert len(payload["scenarios"]) == finished
    assert all(row["passed"] for row in payload["scenarios"])


def test_verify_interrupted_without_out_prints_the_finished_rows() -> None:
    done = _cli(VERIFY, "scenarios@3")
    assert done.returncode == 130, done.stderr
    line = _one_interrupt_line(done, "verify", "SIGINT")
    assert line.endswith("2 of 8 scenarios finished; partial table on stdout")
    assert "PARTIAL (interrupted by SIGINT during the scenarios" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("mamba-tiny/")]
    assert len(rows) == 2 and all(row.endswith(" ok") for row in rows), done.stdout
