"""The bench plots: no two text labels overlap, every point can be named, this
project's paths stand apart from the baselines, mixed-page jobs sit at their
byte-weighted mean page with the page range drawn."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import LineCollection
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


def test_the_overlap_judge_sees_an_overlap() -> None:
    fig, axis = plt.subplots()
    axis.text(0.5, 0.5, "swa-hybrid")
    axis.text(0.52, 0.5, "deepseek-mla")
    axis.text(0.1, 0.9, "alone")
    try:
        assert _overlaps(fig) == [("swa-hybrid", "deepseek-mla")]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-paths", "cpu-paths"])
@pytest.mark.parametrize("sweep", [False, True], ids=["default-run", "sweep-run"])
def test_no_two_labels_overlap(sweep: bool, cuda: bool) -> None:
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
        finally:
            plt.close(fig)


def test_each_preset_is_named_once_per_panel() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        for axis in fig.axes:
            names = [t.get_text() for t in axis.texts if t.get_visible()]
            assert sorted(names) == sorted(cases.CASES), names
    finally:
        plt.close(fig)


def test_legend_sets_this_projects_paths_apart() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        project = labels.index("this project (filled markers):")
        baseline = labels.index("baselines, copy paths in use today (hollow markers):")
        shapes = labels.index("presets (marker shape):")
        assert labels[project + 1 : baseline] == ["triton", "dma", "auto"]
        assert set(labels[baseline + 1 : shapes]) >= {"per-page-copy", "vllm-swap-blocks"}
        assert labels[shapes + 1 :] == list(cases.CASES)
        # in the panels: project points filled, baseline points hollow
        for line in fig.axes[0].lines:
            if line.get_gid():
                _, path = line.get_gid().split("|")
                hollow = line.get_markerfacecolor() == "white"
                assert hollow == (role_of(path) == "baseline"), line.get_gid()
    finally:
        plt.close(fig)


def test_every_point_is_named_by_its_presets_shape() -> None:
    fig = report.preset_figure(_results(sweep=False, cuda=True))
    try:
        (legend,) = fig.legends
        by_label = dict(
            zip([t.get_text() for t in legend.get_texts()], legend.legend_handles, strict=True)
        )
        points = [line for line in fig.axes[0].lines if line.get_gid()]
        assert len(points) == len(cases.CASES) * (len(GPU_PATHS) + 1)
        for line in points:
            case = line.get_gid().split("|")[0]
            assert line.get_marker() == by_label[case].get_marker(), line.get_gid()
        assert len({by_label[c].get_marker() for c in cases.CASES}) == len(cases.CASES)
    finally:
        plt.close(fig)


def test_mixed_page_job_sits_at_its_byte_weighted_mean_with_its_range() -> None:
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
        spans = {
            (round(seg[0][0]), round(seg[1][0]))
            for coll in fig.axes[0].collections
            if isinstance(coll, LineCollection)
            for seg in coll.get_segments()
            if len(seg) == 2 and seg[0][1] == seg[1][1]  # horizontal: a page-range bar
        }
        assert (48 * 1024, 2 * 1024 * 1024) in spans
        # single-size jobs get no bar
        assert not any(lo == 8192 or hi == 8192 for lo, hi in spans)
        label = next(t for t in fig.axes[0].texts if t.get_text() == "mamba-hybrid")
        assert math.isclose(label.get_position()[0], mean)
    finally:
        plt.close(fig)


def test_write_all_writes_both_plots_for_a_sweep_run(tmp_path: Path) -> None:
    written = report.write_all(_results(sweep=True, cuda=False), tmp_path)
    assert written["plot"].name == "bandwidth.png" and written["sweep_plot"].name == "sweep.png"
    markdown = written["markdown"].read_text()
    assert "](bandwidth.png)" in markdown and "](sweep.png)" in markdown
    for key in ("plot", "sweep_plot"):
        assert written[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_close_sweep_page_sizes_keep_their_ticks_apart() -> None:
    """`--page-sizes 16k,17k,18k`: the tick labels would touch; one of them is hidden."""
    results = _results(sweep=False, cuda=False)
    for size in (16 * 1024, 17 * 1024, 18 * 1024):
        case = cases.sweep_case(size, 16)
        results.cases.append(harness.case_summary(case))
        for direction in ("store", "load"):
            results.measurements.append(_row(case, "torch", direction, 3.0, 9))
    fig = report.sweep_figure(results)
    assert fig is not None
    try:
        assert _overlaps(fig) == []
        shown = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_visible()]
        assert "16 KiB" in shown and len(shown) < 3
    finally:
        plt.close(fig)
