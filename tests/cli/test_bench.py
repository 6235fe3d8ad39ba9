"""`triton-offload bench`: argument refusal with a clear message, and a --quick run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from triton_offload.bench import cases, harness, paths, report

from triton_offload.cli import bench as command
from triton_offload.cli import build_parser, main


def test_cli_names_match_the_harness() -> None:
    assert list(command.PRESET_NAMES) == list(cases.CASES)
    assert list(command.PATH_NAMES) == [p for p in paths.ALL_PATHS if p != paths.CEILING]
    assert tuple(command.DIRECTION_NAMES) == paths.DIRECTIONS


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--presets", "llama-70b"], "unknown preset 'llama-70b'"),
        (
            ["--presets", "mla-swa-hybrid"],
            "unknown preset 'mla-swa-hybrid' (a preset of plan only); choose from",
        ),
        (
            ["--presets", "mamba-tiny"],
            "unknown preset 'mamba-tiny' (a preset of plan, verify only)",
        ),
        (["--presets", "deepseek-mla,nope"], "unknown preset 'nope'"),
        (["--paths", "cuda-graph"], "unknown path 'cuda-graph'"),
        (["--directions", "sideways"], "unknown direction 'sideways'"),
        (["--repeats", "0"], "repeats 0 must be >= 1"),
        (["--repeats", "many"], "repeats 'many' is not an integer"),
        (["--warmup", "-1"], "warm-up count -1 must be >= 0"),
        (["--page-sizes", "4x"], "page size '4x' is not a size"),
        (["--pages", "0"], "pages per job 0 must be >= 1"),
        (["--presets", ","], "empty preset list"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert err.count("\n") == 1, err


def test_output_file_names_are_the_reports() -> None:
    assert command.OUTPUT_FILES == (
        report.RESULTS_JSON,
        report.REPORT_MD,
        report.PLOT_PNG,
        report.SWEEP_PNG,
    )


def _no_measuring(*_: object, **__: object) -> None:
    raise AssertionError("measured although --out was refused")


@pytest.mark.parametrize("kind", ["existing file", "below a file", "results file is a folder"])
def test_unusable_out_is_refused_before_measuring(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "run", _no_measuring)
    existing = tmp_path / "results.txt"
    existing.write_text("keep me")
    out, message = {
        "existing file": (existing, "exists and is not a folder"),
        "below a file": (existing / "sub", "cannot write there (Not a directory)"),
        "results file is a folder": (tmp_path, "results.json in it is a folder"),
    }[kind]
    if kind == "results file is a folder":
        (tmp_path / "results.json").mkdir()
    code = main(["bench", "--quick", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith(f"triton-offload bench: error: --out {out}: {message}")
    assert captured.err.count("\n") == 1
    assert existing.read_text() == "keep me"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_unwritable_out_is_refused_before_measuring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc takes no new folders, even for root (tests here may run as root, where
    permission bits do not stop a write)."""
    monkeypatch.setattr(harness, "run", _no_measuring)
    code = main(["bench", "--no-progress", "--out", "/proc/triton-offload-results"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("triton-offload bench: error: --out /proc/triton-offload-results: ")
    assert "cannot write there" in err and err.count("\n") == 1


def test_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.out == Path("bench-results")
    assert args.presets == list(cases.CASES)
    assert args.directions == ["store", "load"]
    assert not args.quick and not args.sweep
    args = build_parser().parse_args(["bench", "--paths", "all", "--page-sizes", "4k,2m"])
    assert args.paths == list(command.PATH_NAMES)
    assert args.page_sizes == [4096, 2 << 20]


def test_quick_run_writes_table_json_report_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--quick",
            "--no-progress",
            "--out",
            str(out),
            "--presets",
            "llama3.1-8b-tp4,mamba-hybrid",
            "--sweep",
            "--page-sizes",
            "4k",
            "--pages",
            "16",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "per-page-copy" in printed and "Summary" in printed
    for name in ("results.json", "report.md", "bandwidth.png", "sweep.png"):
        assert (out / name).stat().st_size > 0
    payload = json.loads((out / "results.json").read_text())
    env = payload["environment"]
    for key in ("gpu", "driver", "torch", "triton"):
        assert key in env
    cases = {m["case"] for m in payload["measurements"]}
    assert cases == {"llama3.1-8b-tp4", "mamba-hybrid", "sweep-4KiBx16"}
    assert all(m["status"] != "FAILED" for m in payload["measurements"])
    timed = [m for m in payload["measurements"] if m["status"] == "ok"]
    assert {m["path"] for m in timed} >= {"torch", "ceiling", "per-page-copy"}
    for m in timed:  # every figure comes with its spread and the jobs actually timed
        assert m["gbps_min"] <= m["gbps"] <= m["gbps_max"]
        # --quick: 3 repeats per path; the ceiling 3 x 3 in each of its two passes
        assert m["repeats"] == (18 if m["path"] == "ceiling" else 3), m
    if not env["cuda_available"]:
        # interpreted Triton paths: correctness only, never a GB/s figure
        assert not any(m["path"] in ("triton", "flat-triton") for m in timed)
        assert any(n.startswith("not run without CUDA: dma") for n in payload["notes"])
        checks = {(c["path"], c["status"]) for c in payload["correctness"]}
        assert checks == {("triton", "verified"), ("flat-triton", "verified")}
    described = {c["name"]: c for c in payload["cases"]}
    assert described["llama3.1-8b-tp4"]["groups"][0]["plane_bytes"] == [8192, 8192]
    report = (out / "report.md").read_text()
    assert "## Cases" in report and "8,192 B + 8,192 B" in report
    # A verdict, or none where a row it would name is noise (a loaded machine): said so.
    for verdict in payload["summary"]:
        said = f"{verdict['case']} {verdict['direction']}: "
        if verdict["noisy"]:
            assert verdict["winner"] is None and said + "no verdict: noisy (" in report
            assert "timed rows are noisy (column `noisy`)" in report
        else:
            assert verdict["winner"] is not None and said + "fastest path" in report
            assert "the best baseline" in verdict["text"]
    for m in timed:  # noise is judged from the row's own numbers
        above = m["role"] != "ceiling" and m["pct_ceiling"] > harness.NOISY_ABOVE_CEILING_PCT
        wide = m["spread"] is not None and m["spread"] > harness.NOISY_SPREAD
        assert (m["noise"] is not None) == (above or wide), m
        assert len(m["job_s"]) == m["repeats"]


def test_a_project_path_that_raises_while_built_is_failed_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that cannot be built (here: a failed calibration job) is a failure of
    the project, not a path this machine lacks."""
    from triton_offload.transfer import engine as engine_module

    def failing_engine(*_: object, **__: object) -> None:
        raise RuntimeError("calibration store job failed")

    monkeypatch.setattr(engine_module, "TransferEngine", failing_engine)
    out = tmp_path / "bench"
    path = "auto" if torch.cuda.is_available() else "torch"  # a project path that runs here
    code = main(
        [
            "bench",
            "--quick",
            "--no-progress",
            "--out",
            str(out),
            "--presets",
            "llama3.1-8b-tp4",
            "--paths",
            f"{path},per-page-copy",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    payload = json.loads((out / "results.json").read_text())
    rows = [m for m in payload["measurements"] if m["path"] == path]
    assert rows and all(m["status"] == "FAILED" for m in rows), rows
    assert all("calibration store job failed" in m["note"] for m in rows)
    assert f"FAILED: {path} on llama3.1-8b-tp4" in err
    baseline = [m for m in payload["measurements"] if m["path"] == "per-page-copy"]
    assert baseline and all(m["status"] == "ok" for m in baseline)
    assert "FAILED" in (out / "report.md").read_text()


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreted pass needs the interpreter"
)
def test_a_project_path_that_raises_in_the_interpreted_check_is_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from triton_offload.transfer import engine as engine_module

    def failing_engine(*_: object, **__: object) -> None:
        raise RuntimeError("calibration load job failed")

    monkeypatch.setattr(engine_module, "TransferEngine", failing_engine)
    config = harness.Config(
        presets=[],
        sweep=False,
        directions=["store", "load"],
        repeats=1,
        warmup=0,
        paths=["triton"],
        quick=True,
        device=torch.device("cpu"),
        target_bytes=cases.QUICK_TARGET_BYTES,
        sweep_page_bytes=[],
        sweep_pages=[],
        sweep_max_bytes=1,
        max_seconds=None,
    )
    rows = harness.correctness_pass(config)
    assert rows and all(r.status == "FAILED" for r in rows), rows
    assert "calibration load job failed" in rows[0].note


def test_sweep_only_measures_no_preset(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--no-progress", "--out", str(out), "--sweep-only"]
    code = main([*argv, "--page-sizes", "4k", "--pages", "16", "--paths", "per-page-copy"])
    assert code == 0
    payload = json.loads((out / "results.json").read_text())
    assert {m["case"] for m in payload["measurements"]} == {"sweep-4KiBx16"}
    assert payload["config"]["presets"] == [] and payload["config"]["sweep"] is True
