"""Progress of long commands: a line when a phase starts, a heartbeat line when a
phase has been quiet for ten seconds (judged with given clock values, not by waiting),
and the self-signal testing aid's syntax."""

from __future__ import annotations

import io
import signal
import sys
from typing import Any

import pytest

from triton_offload.cli import interrupt
from triton_offload.cli.interrupt import HEARTBEAT_SECONDS, PhaseTracker


def test_a_line_when_a_phase_starts_not_at_every_step() -> None:
    stream = io.StringIO()
    tracker = PhaseTracker("bench", stream=stream, labels={"cases": "the timed cases"})
    tracker.enter("cases", "llama3.1-8b-tp4, ceiling")
    tracker.enter("cases", "llama3.1-8b-tp4, torch")
    tracker.enter("host-cost", "llama3.1-8b-tp4")
    lines = stream.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["bench: the timed cases", "bench: host-cost"]
    assert tracker.where() == "host-cost (llama3.1-8b-tp4)"


def test_heartbeat_after_a_quiet_stretch_only() -> None:
    stream = io.StringIO()
    tracker = PhaseTracker("verify", stream=stream)
    tracker.enter("scenarios", "mamba-tiny/dcp1/bpc1/boundary")
    start = tracker._last_line
    assert not tracker.beat_if_quiet(start + HEARTBEAT_SECONDS - 0.5)
    assert tracker.beat_if_quiet(start + HEARTBEAT_SECONDS)
    assert (
        stream.getvalue()
        .splitlines()[-1]
        .startswith("verify: still in scenarios (mamba-tiny/dcp1/bpc1/boundary)")
    )
    # the count starts again from the heartbeat line
    assert not tracker.beat_if_quiet(start + HEARTBEAT_SECONDS + 1)


def test_no_lines_with_progress_off() -> None:
    stream = io.StringIO()
    tracker = PhaseTracker("bench", stream=stream, progress=False)
    tracker.enter("cases")
    with tracker.heartbeat():
        pass
    assert stream.getvalue() == ""


def test_signal_at_syntax() -> None:
    assert interrupt._parse_signal_at("") is None
    assert interrupt._parse_signal_at("cases") == ("cases", 1, signal.SIGINT)
    assert interrupt._parse_signal_at("interpreted@2/SIGTERM") == (
        "interpreted",
        2,
        signal.SIGTERM,
    )


def test_verify_prints_a_line_as_each_scenario_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --backend triton` ran 92 interpreted scenarios in a minute without a line
    (a scenario is a step, and steps reset the heartbeat without printing): a line on
    stderr as each scenario starts, before it ends."""
    from triton_offload.cli import main
    from triton_offload.verify import serving

    real = serving.run_scenario

    def run_scenario(server: Any, scenario: Any, max_new_tokens: int) -> Any:
        result = real(server, scenario, max_new_tokens)
        print(f"FINISHED {scenario.name}", file=sys.stderr)
        return result

    monkeypatch.setattr(serving, "run_scenario", run_scenario)
    argv = ["verify", "--backend", "triton", "--preset", "mamba-tiny", "--dcp", "1"]
    assert main([*argv, "--blocks-per-chunk", "1"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("verify: the scenarios"), lines
    finished = [i for i, line in enumerate(lines) if line.startswith("FINISHED ")]
    assert len(finished) == 8, lines
    previous = 0
    for number, index in enumerate(finished, start=1):
        name = lines[index].removeprefix("FINISHED ")
        started = [
            line
            for line in lines[previous:index]
            if line.startswith(f"verify: scenario {number}/8 {name} [")
        ]
        assert len(started) == 1, lines[previous : index + 1]
        previous = index
