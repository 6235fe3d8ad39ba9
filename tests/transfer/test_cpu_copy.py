"""The memmove CPU path against the plain torch reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import run_oracle
from triton_offload.transfer import cpu_copy
from triton_offload.transfer.jobs import Direction
from triton_offload.transfer.layout import build_layout
from triton_offload.transfer.reference import reference_copy


@pytest.mark.parametrize("subset", [None, (0, 2)])
@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_stacked_runs_equal_the_per_plane_runs(direction: int, subset: tuple | None) -> None:
    """RunBuilder (all planes of a group at once) against plane_runs (one plane at a time)."""
    contiguous = torch.zeros(16, 3, 7, dtype=torch.float16)
    padded = torch.zeros(16, 50, dtype=torch.uint8)[:, 3:40]
    small = torch.zeros(16, 5, dtype=torch.uint8)
    layout = build_layout([[contiguous, padded], [small]], num_groups=2, blocks_per_chunk=4)
    pairs = np.array(
        [[3, 2, 1], [4, 2, 2], [5, 2, 3], [9, 0, 0], [7, 4, 0], [8, 4, 1], [0, 1, 3]],
        dtype=np.int64,
    )
    offsets = np.array([0, 4, 7], dtype=np.int64)
    args = (1 << 40, layout.row_bytes + 32, pairs, offsets, direction, subset)
    stacked = cpu_copy.RunBuilder(layout).runs(*args)
    per_plane = list(run_oracle.plane_runs(layout, *args))
    for name in ("targets", "sources", "lengths"):
        want = np.concatenate([getattr(r, name) for r in per_plane])
        assert getattr(stacked, name).tolist() == want.tolist(), name
    assert stacked.pages == sum(r.pages for r in per_plane)
    assert stacked.page_bytes == sum(r.pages * r.page_bytes for r in per_plane)
    assert stacked.lengths.size < stacked.pages  # the run of group 0 merged


def test_page_runs_merge_pages_adjacent_on_both_sides() -> None:
    cache = np.array([100, 110, 120, 200, 210, 300], dtype=np.int64)
    pool = np.array([0, 10, 20, 30, 45, 55], dtype=np.int64)
    starts_cache, starts_pool, lengths = run_oracle.page_runs(cache, pool, 10)
    # 100-120 / 0-20 merge; 200 follows 120 in the pool but not in the cache; 210 follows
    # 200 in the cache but not in the pool (45 != 40); 300 follows 45 -> 55 in the pool only.
    assert starts_cache.tolist() == [100, 200, 210, 300]
    assert starts_pool.tolist() == [0, 30, 45, 55]
    assert lengths.tolist() == [30, 10, 10, 10]
    empty = run_oracle.page_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), 10)
    assert [a.size for a in empty] == [0, 0, 0]


def random_bytes(tensor: torch.Tensor, seed: int) -> None:
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).clone()


@pytest.mark.parametrize(
    ("threads", "small_pages"),
    [(1, 0), (3, 0), (1, cpu_copy.SMALL_JOB_PAGES)],
    ids=["one-thread", "three-threads", "small-job"],
)
@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_copy_pages_matches_reference(
    direction: int, threads: int, small_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The three ways through copy_pages: merged runs on one thread, the threaded path
    # (thresholds at zero: every job takes it when threads > 1), and the per-page path
    # of small jobs (the job below has 15 pages).
    monkeypatch.setattr(cpu_copy, "SMALL_JOB_PAGES", small_pages)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_JOB_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "PARALLEL_MIN_RUN_BYTES", 0)
    monkeypatch.setattr(cpu_copy, "copy_threads", lambda: threads)
    shares: list[int] = []
    real_memmove_all = cpu_copy._memmove_all

    def counting(targets: list[int], sources: list[int], lengths: list[int]) -> None:
        shares.append(len(targets))
        real_memmove_all(targets, sources, lengths)

    monkeypatch.setattr(cpu_copy, "_memmove_all", counting)
    blocks_per_chunk = 4
    results = []
    for path in ("memmove", "reference"):
        contiguous = torch.empty(16, 3, 7, dtype=torch.float16)  # 42 B pages, runs merge
        padded_storage = torch.empty(16, 50, dtype=torch.uint8)
        padded = padded_storage[:, 3:40]  # 37 B pages, 50 B stride: never merged
        small = torch.empty(16, 5, dtype=torch.uint8)
        for seed, tensor in enumerate((contiguous, padded_storage, small)):
            random_bytes(tensor, seed)
        layout = build_layout(
            [[contiguous, padded], [small]], num_groups=2, blocks_per_chunk=blocks_per_chunk
        )
        pool = torch.randint(
            0,
            256,
            (5, layout.row_bytes),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(9),
        )
        # Group 0: blocks 3,4,5 -> row 2 slots 1..3 (a run), 9 -> row 0 slot 0; group 1.
        pairs = np.array(
            [[3, 2, 1], [4, 2, 2], [5, 2, 3], [9, 0, 0], [7, 4, 0], [8, 4, 1], [0, 1, 3]],
            dtype=np.int64,
        )
        offsets = np.array([0, 4, 7], dtype=np.int64)
        if path == "memmove":
            moved = cpu_copy.copy_pages(
                layout, pool.data_ptr(), layout.row_bytes, pairs, offsets, direction
            )
            assert moved == 4 * (42 + 37) + 3 * 5
            # The threaded path hands one interleaved share of the runs to each thread,
            # the one-thread path all runs at once, the small-job path copies page by page.
            assert len(shares) == (0 if small_pages else threads)
        else:
            reference_copy(
                [plane.view for plane in layout.planes],
                layout,
                torch.from_numpy(pairs),
                torch.from_numpy(offsets),
                pool,
                Direction(direction),
            )
        results.append(
            [pool.clone(), *(storage_bytes(t) for t in (contiguous, padded_storage, small))]
        )
    memmove, reference = results
    assert all(torch.equal(a, b) for a, b in zip(memmove, reference, strict=True))
