"""The launch-grid sweep (bench/grid_sweep.py) under the interpreter: every tile size it
offers copies every byte, against caches filled with random bytes, and each point is
handed out as soon as it is measured."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_offload.bench import grid_sweep
from triton_offload.bench.paths import build_workspace

from tests.helpers.grid_case import CASE
from triton_offload.transfer.jobs import TO_POOL

# The sweep's CPU run: with CUDA (and no interpreter) the kernel cannot take CPU tensors.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
)


def test_every_offered_tile_copies_every_pool_byte_exactly() -> None:
    assert max(grid_sweep.TILE_SIZES) > 8192  # the sweep offers tiles above the default
    seen: list[dict[str, Any]] = []
    rows = grid_sweep.sweep_grid(
        CASE,
        torch.device("cpu"),
        [2, 3],
        grid_sweep.TILE_SIZES,
        repeats=1,
        deadline=math.inf,
        on_row=seen.append,
    )
    assert {(r["tile_bytes"], r["num_programs"]) for r in rows} == {
        (tile, count) for tile in grid_sweep.TILE_SIZES for count in (2, 3)
    }
    assert seen == rows  # each point handed out as it was measured
    for row in rows:
        # Every pool byte compared (the whole pool, unaddressed rows included), store
        # and load, against random cache contents.
        assert row["exact"] is True, row
        assert row["checked_pool_bytes"] == row["pool_bytes"] > 0


def test_the_exactness_check_fills_the_caches_with_random_bytes() -> None:
    """A store that wrote what never-filled caches hold (zeros) must not pass."""
    ws = build_workspace(CASE, torch.device("cpu"), seed=3)
    for tensor in ws.backing:
        tensor.zero_()
    engine = grid_sweep.make_engine(ws, 4096)
    try:

        def zeros_store(spec: Any, direction: int, assignment: Any) -> Any:
            if direction == TO_POOL:
                for plane in ws.layout.planes:
                    view = engine.pool_view(ws.layout.planes.index(plane))
                    view[ws.row_index(plane.group), 0] = 0
            return None

        engine.run_unreported = zeros_store  # type: ignore[method-assign]
        problem = grid_sweep.point_problem(ws, engine, seed=5)
    finally:
        engine.shutdown()
    assert problem is not None and "store" in problem
    assert any(bool(t.any()) for t in ws.backing)  # the check filled the caches


def test_main_writes_each_point_as_it_is_measured(tmp_path: Path) -> None:
    code = grid_sweep.main(["--out", str(tmp_path), "--quick", "--max-seconds", "600"])
    assert code == 0
    lines = (tmp_path / "grid-sweep.jsonl").read_text().splitlines()
    points = [json.loads(line) for line in lines]
    summary = json.loads((tmp_path / "grid-sweep.json").read_text())
    assert points == summary["grid"] and points
    assert all(p["exact"] is True for p in points)
    assert {p["tile_bytes"] for p in points} == set(grid_sweep.TILE_SIZES)


@pytest.mark.parametrize("tile", [0, 24, 4095, 3 * 4096])
def test_tile_sizes_that_the_kernel_cannot_run_are_refused(tile: int) -> None:
    ws = build_workspace(CASE, torch.device("cpu"), seed=3)
    with pytest.raises(ValueError, match=f"tile_bytes {tile}"):
        grid_sweep.make_engine(ws, tile)
