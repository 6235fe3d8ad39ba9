"""The start-up calibration's grid points say what their jobs moved, for every bench preset.

A point ``(page bytes, blocks)`` must be measured by jobs that moved exactly ``blocks``
pages of each of their planes, all of ``page`` bytes: a plane of a real job is judged
by the point nearest its own block count. Full-size preset geometry (bare planes, no
memory behind them) and a stand-in engine that records each job instead of running it,
since the jobs need CUDA to be timed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from triton_offload.bench import cases
from triton_offload.bench.paths import spare_blocks

from triton_offload.transfer import selection
from triton_offload.transfer.layout import CacheLayout, Plane
from triton_offload.transfer.selection import TimedRun


def preset_layout(case: cases.Case) -> tuple[CacheLayout, int]:
    """The layout bench's workspace builds for ``case`` (one block per chunk), as bare
    planes at made-up addresses; and its number of pool rows."""
    planes: list[Plane] = []
    address = 1 << 40
    rows = 2
    row_bytes = 0
    for group, shape in enumerate(case.groups):
        num_blocks = shape.blocks_per_job + spare_blocks(shape.blocks_per_job)
        offset = 0
        for layer in range(shape.layers):
            for index, page in enumerate(shape.plane_bytes):
                planes.append(Plane(group, address, page, page, num_blocks, offset, layer, index))
                address += page * num_blocks
                offset += page
        rows += shape.blocks_per_job
        row_bytes = max(row_bytes, offset)
    layout = CacheLayout.from_planes(
        planes,
        num_groups=len(case.groups),
        blocks_per_chunk=1,
        row_bytes=-(-row_bytes // 16) * 16,
        device="cpu",
    )
    return layout, rows


class RecordingEngine(SimpleNamespace):
    """What ``calibrate`` reads of an engine, and its timer: each job is recorded, not run."""

    def __init__(self, layout: CacheLayout, rows: int) -> None:
        super().__init__(layout=layout, calibration_rows=range(rows), cuda=False)
        self.jobs: list[tuple[int, int, int]] = []  # (page bytes, blocks, planes)

    cycles = 0

    def run(self, spec: Any, direction: int, assignment: Any) -> TimedRun:
        ((name, planes),) = assignment
        counts = [np.asarray(blocks).size for blocks in spec.gpu_blocks]
        groups = [g for g, count in enumerate(counts) if count]
        assert len(groups) == 1 and planes
        pages = {self.layout.planes[i].page_bytes for i in planes}
        assert len(pages) == 1
        assert all(self.layout.planes[i].group == groups[0] for i in planes)
        rows = np.asarray(spec.host_blocks[groups[0]])
        assert rows.size == counts[groups[0]] and len(set(rows.tolist())) == rows.size
        page = pages.pop()
        assert page * counts[groups[0]] * len(planes) <= max(
            selection.CALIBRATION_MAX_BYTES, page * counts[groups[0]]
        )
        self.jobs.append((page, counts[groups[0]], len(planes)))
        # Stand-in times: DMA wins above 64 KiB pages (any answer will do here).
        device_s = 1e-6 * counts[groups[0]] * len(planes) * (2 if name == "dma" else 1)
        if name == "dma" and page >= 64 << 10:
            device_s /= 4
        return TimedRun(device_s, 1e-6, gated=True)


@pytest.mark.parametrize("name", list(cases.CASES))
def test_each_point_is_labelled_by_the_pages_its_jobs_moved(name: str) -> None:
    layout, rows = preset_layout(cases.CASES[name])
    engine = RecordingEngine(layout, rows)
    crossover = selection.calibrate(engine, timer=engine)  # type: ignore[arg-type]
    moved = {(page, blocks) for page, blocks, _ in engine.jobs}
    for direction in (0, 1):
        assert set(crossover.grid[direction]) == moved
        assert set(crossover.timings[direction]) == moved
        assert set(crossover.host_timings[direction]) == moved
    for page, blocks, planes in engine.jobs:
        assert crossover.planes[(page, blocks)] == planes
    # Every job of a point moved the same pages: the label is what was measured.
    assert len(set(engine.jobs)) == len(moved)
    described = "\n".join(crossover.describe())
    for page, blocks, planes in set(engine.jobs):
        assert f"page {page} B x {blocks} blocks ({planes} planes, {planes * blocks} pages)" in (
            described
        )


@pytest.mark.parametrize("name", list(cases.CASES))
def test_points_reach_the_block_counts_of_real_jobs(name: str) -> None:
    """The byte cap takes planes away, not blocks: the largest point of each page size
    has as many blocks as the group, the rows and one plane under the cap allow."""
    case = cases.CASES[name]
    layout, rows = preset_layout(case)
    engine = RecordingEngine(layout, rows)
    selection.calibrate(engine, timer=engine)  # type: ignore[arg-type]
    for page in {page for page, _, _ in engine.jobs}:
        group = max(
            range(layout.num_groups),
            key=lambda g: sum(layout.planes[i].page_bytes == page for i in layout.group_planes[g]),
        )
        reachable = min(
            max(selection.CALIBRATION_PAGES),
            layout.group_num_blocks[group],
            rows,
            max(1, selection.CALIBRATION_MAX_BYTES // page),
        )
        assert max(blocks for p, blocks, _ in engine.jobs if p == page) == reachable
        blocks_per_job = case.groups[group].blocks_per_job
        if page * blocks_per_job <= selection.CALIBRATION_MAX_BYTES:
            assert reachable >= blocks_per_job  # a real job's block count is covered


def test_llama_points_no_longer_collapse_to_eight_blocks() -> None:
    """32 KiB pages x 64 planes: the byte cap once made both points 8 blocks x 64 planes."""
    layout, rows = preset_layout(cases.CASES["llama3.1-8b-tp1"])
    engine = RecordingEngine(layout, rows)
    crossover = selection.calibrate(engine, timer=engine)  # type: ignore[arg-type]
    assert set(crossover.grid[0]) == {(32768, 16), (32768, 130)}  # 130 pool rows
    assert crossover.planes == {(32768, 16): 32, (32768, 130): 3}
