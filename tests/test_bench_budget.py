"""`triton-offload bench --max-seconds`: a run cut by its wall-clock budget (or by SIGINT)
still writes results.json, report.md and the plot with what it measured, and says so."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from triton_offload.bench import harness

from triton_offload.cli import build_parser, main

QUICK = [
    "bench",
    "--quick",
    "--no-progress",
    "--presets",
    "llama3.1-8b-tp4,mamba-hybrid",
    "--paths",
    "torch,per-page-copy",
    "--repeats",
    "1",
]


def test_max_seconds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--max-seconds", "0"])
    assert exit_info.value.code == 2
    assert "max seconds 0 must be >= 1" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "--max-seconds", "90"]).max_seconds == 90
    assert build_parser().parse_args(["bench"]).max_seconds is None


class FakeClock:
    """``time`` for the harness: perf_counter advances ``step`` seconds per call."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def _payload(out: Path) -> dict[str, Any]:
    for name in ("results.json", "report.md", "bandwidth.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "results.json").read_text())


def test_budget_cuts_between_paths_and_cases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = FakeClock(step=1.0)
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    out = tmp_path / "bench"
    code = main([*QUICK, "--max-seconds", "6", "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    payload = _payload(out)
    assert payload["config"]["max_seconds"] == 6
    cut = [m for m in payload["measurements"] if m["note"] == harness.CUT_NOTE]
    assert cut and all(m["status"] == "skipped" for m in cut)
    assert {m["case"] for m in payload["measurements"]} == {"llama3.1-8b-tp4"}
    assert [c["name"] for c in payload["cases"]] == ["llama3.1-8b-tp4"]
    note = payload["notes"][0]
    assert note.startswith("cut: the run's 6 s budget (--max-seconds) ran out after 1 of 2 cases")
    assert "not run: mamba-hybrid" in note
    assert any("correctness pass did not run" in n for n in payload["notes"])
    assert "cut: the run's 6 s budget" in (out / "report.md").read_text()


def test_budget_spent_before_the_first_case_still_writes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock(step=1000.0)
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    out = tmp_path / "bench"
    assert main([*QUICK, "--max-seconds", "1", "--out", str(out)]) == 0
    payload = _payload(out)
    assert payload["measurements"] == [] and payload["cases"] == []
    assert "after 0 of 2 cases" in payload["notes"][0]


def test_interrupt_keeps_the_finished_cases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = harness.run_case
    calls: list[str] = []

    def run_case(case: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(case.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(case, *args, **kwargs)

    monkeypatch.setattr(harness, "run_case", run_case)
    out = tmp_path / "bench"
    # A KeyboardInterrupt (Ctrl-C) is a cut run: exit 130, the partial report beside
    # (never over) a complete one.
    assert main([*QUICK, "--out", str(out)]) == 130
    assert not (out / "results.json").exists()
    payload = json.loads((out / "results.partial.json").read_text())
    assert {m["case"] for m in payload["measurements"]} == {"llama3.1-8b-tp4"}
    assert payload["notes"][0].startswith("cut: interrupted by SIGINT during the timed cases")
    assert payload["partial"]["phase"] == "cases"
    assert payload["host_costs"] == [] and payload["correctness"] == []
