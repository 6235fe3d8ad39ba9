"""Bench arithmetic, verdicts and report writing (results.json, report.md, the plot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from triton_offload.bench import harness, report
from triton_offload.bench.harness import HostCost, Measurement, Results, gbps, percent_of


def test_gbps_is_decimal_gigabytes_per_second() -> None:
    assert gbps(1_000_000_000, 1.0) == 1.0
    assert gbps(256 * 1024 * 1024, 0.01) == pytest.approx(26.8435456)
    assert gbps(32768 * 8192, 0.5) == pytest.approx(0.536870912)


def test_gbps_and_percent_reject_non_positive_denominators() -> None:
    with pytest.raises(ValueError, match="seconds 0"):
        gbps(1, 0.0)
    with pytest.raises(ValueError, match="ceiling -1"):
        percent_of(1.0, -1.0)
    assert percent_of(12.5, 50.0) == 25.0


def _m(
    path: str, role: str, value: float | None, direction: str = "store", **kw: object
) -> Measurement:
    status = kw.pop("status", "ok" if value is not None else "FAILED")
    pct = kw.pop("pct_ceiling", None if value is None else 100 * value / 50.0)
    return Measurement(
        case=str(kw.pop("case", "llama3.1-8b-tp4")),
        path=path,
        role=role,
        direction=direction,
        status=str(status),
        job_bytes=64 << 20,
        job_pages=8192,
        page_bytes=8192,
        page_sizes=[8192],
        device_s=None if value is None else (64 << 20) / value / 1e9,
        host_s=None if value is None else 1e-4,
        gbps=value,
        pct_ceiling=pct,  # type: ignore[arg-type]
        launches=1,
        repeats=5,
        **kw,  # type: ignore[arg-type]
    )


def _results() -> Results:
    rows = [
        _m("ceiling", "ceiling", 50.0),
        _m("triton", "project", 40.0),
        _m("dma", "project", 10.0),
        _m("per-page-copy", "baseline", 5.0),
        _m("flat-triton", "baseline", 20.0),
        _m("batched-dma", "baseline", None, note="not byte-exact: store wrote pool row 3"),
        _m("ceiling", "ceiling", 48.0, direction="load"),
        _m("triton", "project", 12.0, direction="load"),
        _m("flat-triton", "baseline", 24.0, direction="load"),
    ]
    return Results(
        environment={
            "gpu": "NVIDIA H200",
            "driver": "575.51",
            "torch": "2.11.0",
            "triton": "3.6.0",
            "cuda_runtime": "12.8",
            "cuda_available": True,
            "vllm": None,
        },
        config={"directions": ["store", "load"], "repeats": 5, "warmup": 1},
        measurements=rows,
        host_costs=[HostCost("llama3.1-8b-tp4", 128, 64, 8192, 1e-4, 4e-4, "numpy re-creation")],
        correctness=[],
        notes=["a note"],
        wall_s=1.5,
    )


def test_verdict_names_winner_and_ratios_from_same_case() -> None:
    store, load = report.verdicts(_results().measurements)
    assert store.winner is not None and store.winner.path == "triton"
    assert store.best_baseline is not None and store.best_baseline.path == "flat-triton"
    assert store.project_vs_baseline == pytest.approx(2.0)
    text = store.sentence()
    assert "**triton**" in text and "2.00x the best baseline flat-triton" in text
    assert "80% of the ceiling (50.00 GB/s)" in text
    # a baseline may win: the ratio is then below 1
    assert load.winner is not None and load.winner.path == "flat-triton"
    assert load.project_vs_baseline == pytest.approx(0.5)


def test_failed_paths_never_win() -> None:
    rows = [_m("batched-dma", "baseline", None), _m("triton", "project", 1.0)]
    (verdict,) = report.verdicts(rows)
    assert verdict.best_baseline is None and verdict.winner is not None
    assert verdict.winner.path == "triton"


def test_write_all_writes_json_markdown_and_png(tmp_path: Path) -> None:
    results = _results()
    written = report.write_all(results, tmp_path / "out")
    payload = json.loads(written["json"].read_text())
    env = payload["environment"]
    assert {env["gpu"], env["driver"], env["torch"], env["triton"]} == {
        "NVIDIA H200",
        "575.51",
        "2.11.0",
        "3.6.0",
    }
    assert len(payload["measurements"]) == 9
    failed = [m for m in payload["measurements"] if m["status"] == "FAILED"]
    assert failed and failed[0]["gbps"] is None and failed[0]["device_s"] is None
    summary = payload["summary"][0]
    assert summary["winner"] == "triton" and summary["best_baseline"] == "flat-triton"
    assert summary["project_vs_best_baseline"] == pytest.approx(2.0)
    assert summary["ceiling_gbps"] == 50.0
    assert payload["host_costs"][0]["ratio"] == pytest.approx(4.0)

    markdown = written["markdown"].read_text()
    assert "fastest path **triton**" in markdown
    assert "2.00x the best baseline flat-triton" in markdown
    assert "NVIDIA H200" in markdown and "driver: 575.51" in markdown
    assert "](bandwidth.png)" in markdown
    assert "not byte-exact" in markdown

    png = written["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_terminal_report_has_table_summary_and_host_cost() -> None:
    text = report.terminal_report(_results())
    assert "flat-triton" in text and "GB/s" in text
    assert "fastest path triton" in text
    assert "4.0x" in text  # host cost ratio
    assert "a note" in text


def test_text_table_aligns_columns() -> None:
    table = report.text_table(["a", "bb"], [["xxx", "y"], ["z", "wwww"]])
    lines = table.splitlines()
    assert lines[0] == "a    bb"
    assert lines[2] == "xxx  y"
    assert lines[3] == "z    wwww"


def test_missing_matplotlib_skips_only_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_matplotlib(*_: object) -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plot", no_matplotlib)
    written = report.write_all(_results(), tmp_path)
    assert set(written) == {"json", "markdown"}
    markdown = written["markdown"].read_text()
    assert "plot skipped: matplotlib is not installed" in markdown
    assert "bandwidth.png" not in markdown
    notes = json.loads(written["json"].read_text())["notes"]
    assert any("plot skipped" in n for n in notes)


def test_report_shows_spread_jobs_statuses_and_the_ceilings_range(tmp_path: Path) -> None:
    results = _results()
    ceiling = results.measurements[0]
    ceiling.gbps_min, ceiling.gbps_max, ceiling.repeats = 41.0, 52.5, 30
    triton = results.measurements[1]
    triton.gbps_min, triton.gbps_max = 37.5, 40.5
    results.measurements.append(
        _m("auto", "project", None, status="skipped", note=harness.CUT_NOTE)
    )
    markdown = report.write_all(results, tmp_path)["markdown"].read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| case | dir | path"))
    assert "| GB/s | min-max | jobs |" in header
    assert "| triton | project | ok | 40.00 | 37.50-40.50 | 5 |" in markdown
    assert "| auto | project | cut | - | - | - |" in markdown
    # the ceiling's own spread, in the summary and in its section
    assert "80% of the ceiling (50.00 GB/s; its 30 jobs ranged 41.00-52.50)" in markdown
    assert "## Ceiling spread" in markdown
    assert "| llama3.1-8b-tp4 | store | 50.00 | 41.00 | 52.50 | 1.28 | 30 |" in markdown
    # what the statuses mean, and the repeats actually used
    for status in ("`ok`: verified byte-exact first", "`cut`: not started", "`unavailable`:"):
        assert status in markdown
    assert "`FAILED`: not byte-exact, or it crashed" in markdown
    assert "--repeats 5 per path" in markdown and "15 jobs before the other paths" in markdown
    assert "Repeats per figure" not in markdown


def test_status_of_names_a_cut_path() -> None:
    assert report.status_of(_m("dma", "project", None, status="skipped", note="x")) == "skipped"
    cut = _m("dma", "project", None, status="skipped", note=harness.CUT_NOTE)
    assert report.status_of(cut) == "cut"
    assert set(report.STATUS_MEANINGS) == {
        "ok",
        "verified",
        "cut",
        "skipped",
        "unavailable",
        "FAILED",
    }


def _noisy_results() -> Results:
    """Store: torch above the ceiling (a slow moment during the ceiling's jobs). Load:
    the middle half of per-page-copy's jobs spread over 60% of their median. The rows
    of another case are steady."""
    results = _results()
    results.measurements = [
        _m("ceiling", "ceiling", 2.0, gbps_min=1.9, gbps_max=2.1),
        _m("torch", "project", 6.78, gbps_min=6.5, gbps_max=7.0, pct_ceiling=339.0),
        _m("per-page-copy", "baseline", 1.9, gbps_min=1.8, gbps_max=2.0, pct_ceiling=95.0),
        _m("ceiling", "ceiling", 8.0, direction="load", gbps_min=7.9, gbps_max=8.1),
        _m("torch", "project", 3.0, direction="load", gbps_min=2.9, gbps_max=3.1),
        _m(
            "per-page-copy",
            "baseline",
            4.0,
            direction="load",
            gbps_min=1.5,
            gbps_max=6.0,
            spread=0.6,
        ),
        _m("ceiling", "ceiling", 10.0, case="steady", gbps_min=9.9, gbps_max=10.1),
        _m("torch", "project", 8.0, case="steady", gbps_min=7.9, gbps_max=8.1),
        _m("per-page-copy", "baseline", 2.0, case="steady", gbps_min=1.9, gbps_max=2.1),
    ]
    return results


def test_noise_is_judged_from_the_ceiling_and_the_spread() -> None:
    rows = {(m.case, m.direction, m.path): m for m in _noisy_results().measurements}
    above = harness.noise_of(rows[("llama3.1-8b-tp4", "store", "torch")])
    assert above is not None and "339% of the ceiling" in above
    spread = harness.noise_of(rows[("llama3.1-8b-tp4", "load", "per-page-copy")])
    assert spread is not None and "middle half of its 5 jobs spread over 60%" in spread
    assert "jobs ranged 1.50-6.00 GB/s" in spread
    for key, m in rows.items():
        if key not in {
            ("llama3.1-8b-tp4", "store", "torch"),
            ("llama3.1-8b-tp4", "load", "per-page-copy"),
        }:
            assert harness.noise_of(m) is None, key
    # within a few percent of the ceiling is measurement error, not noise; so is a
    # spread under a quarter of the median, and one slow job (the range) alone
    assert harness.noise_of(_m("dma", "project", 40.0, pct_ceiling=104.0)) is None
    steady = _m("dma", "project", 40.0, spread=0.2, gbps_min=0.5, gbps_max=41.0)
    assert harness.noise_of(steady) is None
    assert harness.spread_of([1.0]) is None
    assert harness.spread_of([1.0, 2.0, 3.0]) == pytest.approx(0.5)  # half the range
    assert harness.spread_of([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # one preempted job
    # rows without a figure are never noisy
    assert harness.noise_of(_m("dma", "project", None)) is None


def test_no_verdict_from_noisy_rows(tmp_path: Path) -> None:
    results = _noisy_results()
    store, load, steady = report.verdicts(results.measurements)
    for verdict in (store, load):
        text = verdict.sentence()
        assert "no verdict: noisy" in text, text
        assert "fastest" not in text and "x the best baseline" not in text, text
        assert verdict.winner is None and verdict.project_vs_baseline is None
    assert "torch: 339% of the ceiling" in store.sentence()
    assert "per-page-copy: the middle half of its 5 jobs spread over 60%" in load.sentence()
    assert "fastest path **torch**" in steady.sentence() and steady.noisy == ()

    written = report.write_all(results, tmp_path)
    payload = json.loads(written["json"].read_text())
    noise = {(m["case"], m["direction"], m["path"]): m["noise"] for m in payload["measurements"]}
    assert noise[("llama3.1-8b-tp4", "store", "torch")].startswith("339% of the ceiling")
    assert noise[("steady", "store", "torch")] is None
    summary = {(s["case"], s["direction"]): s for s in payload["summary"]}
    assert summary[("llama3.1-8b-tp4", "store")]["winner"] is None
    assert summary[("llama3.1-8b-tp4", "store")]["noisy"] == ["torch"]
    assert summary[("steady", "store")]["winner"] == "torch"
    markdown = written["markdown"].read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| case | dir | path"))
    assert header.endswith("| noisy | note |")
    assert "| torch | project | ok | 6.78 |" in markdown and "| 339% ceil |" in markdown
    assert "| IQR 60% |" in markdown
    assert "2 of 9 timed rows are noisy" in markdown
    assert "quieter machine" in markdown and "--repeats" in markdown
    text = report.terminal_report(results)
    assert "no verdict: noisy" in text and "2 of 9 timed rows are noisy" in text


def test_a_noisy_ceiling_gives_no_percentage() -> None:
    rows = [
        _m("ceiling", "ceiling", 5.0, gbps_min=2.27, gbps_max=8.49, spread=0.8),
        _m("torch", "project", 4.0, gbps_min=3.9, gbps_max=4.1, pct_ceiling=80.0),
        _m("per-page-copy", "baseline", 1.0, gbps_min=0.98, gbps_max=1.02, pct_ceiling=20.0),
    ]
    (verdict,) = report.verdicts(rows)
    text = verdict.sentence()
    assert "fastest path **torch**" in text and "4.00x the best baseline" in text
    assert "% of the ceiling" not in text
    assert "no share of the ceiling: the ceiling is noisy" in text


def test_steady_rows_have_no_noise_note() -> None:
    text = report.terminal_report(_results())
    assert "timed rows are noisy" not in text
