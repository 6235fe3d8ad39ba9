"""The bench plots: no two text labels and no two markers overlap, every point sits in
its preset's panel, this project's paths stand apart from the baselines, the y range
follows the paths (the ceiling is a line and a band that never set the scale, never a
marker), mixed-page jobs name their page range."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text
from triton_offload.bench import cases, harness, report
from triton_offload.bench.harness import Measurement, Results
from triton_offload.bench.paths import role_of

GPU_PATHS = [
    "triton", "dma", "auto", "per-page-copy", "flat-triton", "batched-dma", "vllm-swap-blocks",
]  # fmt: skip
CPU_PATHS = ["torch", "per-page-copy", "index-copy"]


def _row(case: cases.Case, path: str, direction: str, value: float, jobs: int) -> Measurement:
    return Measurement(
        case=case.name,
        path=path,
        role=role_of(path),
        direction=direction,
        status="ok",
        job_bytes=case.job_bytes,
        job_pages=case.job_pages,
        page_bytes=case.typical_page_bytes,
        page_sizes=list(case.page_sizes),
        sweep=case.sweep,
        device_s=case.job_bytes / value / 1e9,
        gbps=value,
        gbps_min=value * 0.8,
        gbps_max=value * 1.1,
        repeats=jobs,
    )


def _results(*, sweep: bool, cuda: bool) -> Results:
    """Every preset (and the default sweep grid) on every path, figures close together
    (the worst case for labels); one row is cut and one unavailable (never drawn)."""
    paths = GPU_PATHS if cuda else CPU_PATHS
    timed = list(cases.CASES.values())
    if sweep:
        grid, _ = cases.sweep_cases(max_job_bytes=400 * cases.MiB)
        timed += grid
    rows = []
    for i, case in enumerate(timed):
        for direction in ("store", "load"):
            rows.append(_row(case, "ceiling", direction, 20.0 + i, 54))
            for j, path in enumerate(paths):
                rows.append(_row(case, path, direction, 5.0 + 0.5 * i + 0.3 * j, 7))
    rows.append(
        Measurement("swa-hybrid", "dma", "project", "load", "skipped", note=harness.CUT_NOTE)
    )
    rows.append(Measurement("swa-hybrid", "batched-dma", "baseline", "load", "unavailable"))
    return Results(
        environment={"gpu": "NVIDIA H200" if cuda else None, "cuda_available": cuda},
        config={"directions": ["store", "load"], "repeats": 7, "warmup": 2},
        measurements=rows,
        host_costs=[],
        correctness=[],
        notes=[],
        cases=[harness.case_summary(c) for c in timed],
    )


def _in_figure(t: Text) -> bool:
    return t.get_visible() and bool(t.get_text().strip()) and t.figure is not None


def _overlaps(fig: Any) -> list[tuple[str, str]]:
    """Every pair of visible, non-empty text labels whose rendered boxes intersect
    (by more than half a pixel each way)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if _in_figure(t)]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    bad = []
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        dx = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
        dy = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
        if dx > 0.5 and dy > 0.5:
            bad.append((a, b))
    return bad


def _marker_overlaps(fig: Any) -> list[tuple[str, str]]:
    """Every pair of drawn markers of one panel whose discs intersect (by more than half
    a pixel), named by the lines' gids (or labels) and the point's index."""
    fig.canvas.draw()
    bad = []
    for axis in fig.axes:
        points = []
        for line in axis.get_lines():
            marker = line.get_marker()
            if (
                not line.get_visible()
                or marker in (None, "", "None", " ")
                or not line.get_markersize()
            ):
                continue
            radius = line.get_markersize() * fig.dpi / 72 / 2
            name = line.get_gid() or line.get_label()
            xy = axis.transData.transform(line.get_xydata())
            points += [(f"{name}#{i}", x, y, radius) for i, (x, y) in enumerate(xy)]
        for (a, xa, ya, ra), (b, xb, yb, rb) in itertools.combinations(points, 2):
            if math.hypot(xa - xb, ya - yb) < ra + rb - 0.5:
                bad.append((a, b))
    return bad


def test_the_overlap_judge_sees_an_overlap() -> None:
    fig, axis = plt.subplots()
    axis.text(0.5, 0.5, "swa-hybrid")
    axis.text(0.52, 0.5, "deepseek-mla")
    axis.text(0.1, 0.9, "alone")
    try:
        assert _overlaps(fig) == [("swa-hybrid", "deepseek-mla")]
    finally:
        plt.close(fig)


def test_the_marker_judge_sees_an_overlap() -> None:
    """Two presets 1 KiB apart near 16 KiB, drawn at their page sizes: their markers
    touch (the old single-axis plot put swa-hybrid and deepseek-mla this close)."""
    fig, axis = plt.subplots()
    axis.set_xscale("log", base=2)
    axis.set_xlim(4096, 4 << 20)
    axis.set_ylim(0, 20)
    axis.plot([16384], [3.0], "v", markersize=6, gid="swa-hybrid")
    axis.plot([17408], [3.1], "D", markersize=6, gid="deepseek-mla")
    axis.plot([1 << 20], [3.0], "o", markersize=6, gid="mamba-hybrid")
    axis.plot([4096, 1 << 20], [3.0, 3.0], "--", gid="no markers")
    try:
        assert _marker_overlaps(fig) == [("swa-hybrid#0", "deepseek-mla#0")]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-paths", "cpu-paths"])
@pytest.mark.parametrize("sweep", [False, True], ids=["default-run", "sweep-run"])
def test_no_two_labels_or_markers_overlap(sweep: bool, cuda: bool) -> None:
    results = _results(sweep=sweep, cuda=cuda)
    figures = [report.preset_figure(results)]
    if sweep:
        figures.append(report.sweep_figure(results))
    else:
        assert report.sweep_figure(results) is None
    for fig in figures:
        assert fig is not None
        try:
            assert _overlaps(fig) == []
            assert _marker_overlaps(fig) == []
        finally:
            plt.close(fig)


def _panels(fig: Any) -> dict[tuple[int, str], Any]:
    """(row, preset) -> panel of the preset figure; the preset is the title's first line."""
    rows = fig.axes[0].get_gridspec().nrows
    columns = len(fig.axes) // rows
    titles = [axis.get_title().split("\n")[0] for axis in fig.axes[:columns]]
    return {(i // columns, titles[i % columns]): axis for i, axis in enumerate(fig.axes)}


def test_one_panel_per_preset_and_direction() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        panels = _panels(fig)
        assert sorted(panels) == sorted((r, c) for r in (0, 1) for c in cases.CASES)
        assert fig.axes[0].get_ylabel().startswith("store")
        assert _panels(fig)[(1, "deepseek-mla")].get_ylabel() == ""
    finally:
        plt.close(fig)


def test_legend_sets_this_projects_paths_apart() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        project = labels.index("this project (filled markers, solid lines):")
        baseline = labels.index("baselines, copy paths in use today (hollow, dashed):")
        reference = labels.index("reference (no marker):")
        assert labels[project + 1 : baseline] == ["triton", "dma", "auto"]
        assert set(labels[baseline + 1 : reference]) >= {"per-page-copy", "vllm-swap-blocks"}
        assert labels[reference + 1].startswith("ceiling: one contiguous copy")
        # in the panels: project points filled circles, baseline points hollow squares
        for axis in fig.axes:
            for line in axis.lines:
                gid = line.get_gid() or ""
                if "|" in gid and not gid.endswith("ceiling"):
                    path = gid.split("|")[1]
                    hollow = line.get_markerfacecolor() == "white"
                    assert hollow == (role_of(path) == "baseline"), gid
                    assert line.get_marker() == ("s" if hollow else "o"), gid
    finally:
        plt.close(fig)


@pytest.mark.parametrize("sweep", [False, True], ids=["preset-plot", "sweep-plot"])
def test_the_ceiling_is_a_line_never_a_marker(sweep: bool) -> None:
    results = _results(sweep=sweep, cuda=True)
    fig = report.sweep_figure(results) if sweep else report.preset_figure(results)
    assert fig is not None
    try:
        ceilings = [
            line
            for axis in fig.axes
            for line in axis.lines
            if (line.get_gid() or "").endswith("ceiling")
        ]
        assert ceilings
        for line in ceilings:
            assert line.get_marker() in (None, "", "None"), line.get_gid()
            assert line.get_linestyle() == "--" and line.get_color() == "black"
        # and no line with a filled marker is black
        for axis in fig.axes:
            for line in axis.lines:
                if line.get_marker() not in (None, "", "None"):
                    assert line.get_color() != "black", line.get_gid()
    finally:
        plt.close(fig)


def test_y_range_follows_the_paths_not_the_ceiling() -> None:
    """Ceilings at 20+ GB/s, paths at 5-12: every panel's range is its paths' own, and
    the ceiling's value is written in the panel with an arrow (off scale)."""
    results = _results(sweep=True, cuda=False)
    figures = [report.preset_figure(results), report.sweep_figure(results)]
    try:
        for fig in figures:
            assert fig is not None
            for axis in fig.axes:
                tops = [
                    y
                    for line in axis.lines
                    if "ceiling" not in (line.get_gid() or "")
                    and line.get_marker() not in (None, "", "None")
                    for y in line.get_ydata()
                ]
                assert tops, axis.get_title()
                low, high = axis.get_ylim()
                assert low == 0 and max(tops) * 1.1 <= high <= max(tops) * 1.1 * report.HEADROOM
                notes = [t.get_text() for t in axis.texts if t.get_text().startswith("ceiling")]
                assert len(notes) == 1 and notes[0].endswith("GB/s \u2191"), notes
    finally:
        for fig in figures:
            plt.close(fig)


def test_every_point_sits_in_its_presets_panel() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        points = 0
        for (_, case), axis in _panels(fig).items():
            for line in axis.lines:
                gid = line.get_gid() or ""
                if "|" in gid and not gid.endswith("ceiling"):
                    assert gid.split("|")[0] == case, gid
                    points += 1
        assert points == 2 * len(cases.CASES) * len(GPU_PATHS)
    finally:
        plt.close(fig)


def test_mixed_page_job_names_its_byte_weighted_mean_and_range() -> None:
    results = _results(sweep=False, cuda=True)
    # mamba-hybrid, full size: 12 attention layers x 8 blocks x two 256 KiB pages, and
    # 36 Mamba layers x 1 block x (48 KiB conv + 2 MiB SSM state).
    by_page = {
        256 * 1024: 12 * 8 * 2 * 256 * 1024,
        48 * 1024: 36 * 48 * 1024,
        2 * 1024 * 1024: 36 * 2 * 1024 * 1024,
    }
    mean = sum(p * b for p, b in by_page.items()) / sum(by_page.values())
    assert report._mean_pages(results)["mamba-hybrid"] == pytest.approx(
        (mean, 48 * 1024, 2 * 1024 * 1024)
    )
    fig = report.preset_figure(results)
    try:
        titles = {axis.get_title() for axis in fig.axes if axis.get_title()}
        assert f"mamba-hybrid\n48 KiB-2 MiB pages\nmean {report._page_label(mean)}" in titles
        assert "llama3.1-8b-tp4\n8 KiB pages" in titles  # a single-size job: its size
    finally:
        plt.close(fig)


def test_write_all_writes_both_plots_for_a_sweep_run(tmp_path: Path) -> None:
    written = report.write_all(_results(sweep=True, cuda=False), tmp_path)
    assert written["plot"].name == "bandwidth.png" and written["sweep_plot"].name == "sweep.png"
    markdown = written["markdown"].read_text()
    assert "](bandwidth.png)" in markdown and "](sweep.png)" in markdown
    for key in ("plot", "sweep_plot"):
        assert written[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["bandwidth.png", "sweep.png", "results.json", "report.md"]
    )  # no staged file left behind


def test_close_sweep_page_sizes_keep_their_ticks_apart() -> None:
    """`--page-sizes 16k,17k,18k`: one slot per size, every label shown, none touching."""
    results = _results(sweep=False, cuda=False)
    for size in (16 * 1024, 17 * 1024, 18 * 1024):
        case = cases.sweep_case(size, 16)
        results.cases.append(harness.case_summary(case))
        for direction in ("store", "load"):
            results.measurements.append(_row(case, "torch", direction, 3.0, 9))
    fig = report.sweep_figure(results)
    assert fig is not None
    try:
        assert _overlaps(fig) == [] and _marker_overlaps(fig) == []
        shown = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_visible()]
        assert shown == ["16 KiB", "17 KiB", "18 KiB"]
    finally:
        plt.close(fig)
