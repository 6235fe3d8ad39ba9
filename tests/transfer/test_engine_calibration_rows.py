"""The start-up calibration on a pool whose rows other engines share.

Under a replicated layout every rank's pool is the same rows of one region; ranks that
calibrate at once must not store into and load from the same rows (a rank would load
another's bytes into its caches). ``calibration_rows=(k, n)`` keeps an engine's
calibration to the k-th of n disjoint slices of the rows. Checked on the CPU: the torch
copier against the DMA copier (a host-memmove stand-in for the driver), the engine's own
submit path; rows outside the slice keep their poison byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hybrid_engine import (
    NUM_HOST_BLOCKS,
    _HostCopies,
    hybrid_caches,
    hybrid_plan,
    same_bytes,
    snapshot,
)
from triton_offload.transfer import selection
from triton_offload.transfer.copiers import DmaCopier
from triton_offload.transfer.engine import TransferEngine


def _calibrated_rows(rows: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> set[int]:
    caches, storages = hybrid_caches(seed=41)
    engine = TransferEngine(
        hybrid_plan(1), caches, NUM_HOST_BLOCKS, backend="torch", calibration_rows=rows
    )
    engine.copiers["dma"] = DmaCopier(
        engine.layout, engine.pool_address, engine.row_stride, _HostCopies()
    )
    monkeypatch.setattr(selection, "CALIBRATION_PAGES", (2, 5))
    monkeypatch.setattr(selection, "CALIBRATION_REPEATS", 1)
    poison = torch.randint(
        0, 256, engine.pool.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    engine.pool.copy_(poison)
    before = snapshot(storages)
    crossover = selection.calibrate(engine, ("torch", "dma"))
    assert crossover.grid[0] and crossover.grid[1]
    assert same_bytes(storages, before)  # each load wrote back what its store read
    touched = {r for r in range(NUM_HOST_BLOCKS) if not torch.equal(engine.pool[r], poison[r])}
    engine.shutdown()
    return touched


def test_each_engine_calibrates_on_its_own_slice_of_the_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slices = []
    for k in range(3):
        touched = _calibrated_rows((k, 3), monkeypatch)
        own = set(range(3 * k, 3 * k + 3))  # 9 rows in 3 slices
        assert touched and touched <= own
        slices.append(own)
    assert set().union(*slices) == set(range(NUM_HOST_BLOCKS))
    # The default is one slice: all rows may be used (the 5-page jobs need 5 rows).
    assert len(_calibrated_rows((0, 1), monkeypatch)) >= 5


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        ((3, 3), ValueError, r"calibration_rows \(3, 3\) needs n >= 1 and 0 <= k < n"),
        ((-1, 2), ValueError, r"calibration_rows \(-1, 2\)"),
        ((0, 0), ValueError, r"calibration_rows \(0, 0\)"),
        ((0, 10), ValueError, r"10 slices of 9 pool rows"),
        ((1,), TypeError, r"calibration_rows must be a tuple \(k, n\) of two ints, got \(1,\)"),
        ((True, 2), TypeError, r"got \(True, 2\)"),
        ([0, 2], TypeError, r"got \[0, 2\]"),
    ],
)
def test_bad_calibration_rows_are_refused(rows: object, error: type, match: str) -> None:
    caches, _ = hybrid_caches()
    with pytest.raises(error, match=match):
        TransferEngine(
            hybrid_plan(1),
            caches,
            NUM_HOST_BLOCKS,
            backend="torch",
            calibration_rows=rows,  # type: ignore[arg-type]
        )
    engine = TransferEngine(hybrid_plan(1), caches, NUM_HOST_BLOCKS, backend="torch")
    assert engine.calibration_rows == range(NUM_HOST_BLOCKS)
