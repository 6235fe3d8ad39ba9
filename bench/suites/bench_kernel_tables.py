"""Host cost of the copy kernel's per-job work: pair-table validation and the launch.

Per job the host builds and checks an ``[n, 3]`` pair table; the design keeps this
O(pairs), independent of the number of layers (planes). Geometry: a hybrid model with
a 64-plane attention group (32 layers x K/V, 8 KiB pages), a 2-plane Mamba group and a
64-plane sliding-window group; a job of 2,048 pairs per group (a 32k-token prefix at
16 tokens per block). ``validate_pairs`` should cost well under a millisecond; each
case records ``us_per_pair`` in ``extra_info`` and prints it (``-s``).

``layout_build`` is a once-per-registration cost, shown for scale. ``launch_enqueue``
(CUDA only) is the host time of one ``launch_copy`` (enqueue, no synchronisation).

Run: ``python -m pytest bench/suites/bench_kernel_tables.py --benchmark-enable``; without it
each case runs once as a smoke test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from triton_offload.kernels.copy_blocks import TILE_BYTES

from triton_offload.transfer.copiers import KernelTables, kernel_tables
from triton_offload.transfer.jobs import Direction, validate_pairs
from triton_offload.transfer.layout import CacheLayout, Plane

NUM_BLOCKS = 8192
BLOCKS_PER_CHUNK = 1
PAIRS_PER_GROUP = 2048
#: (group, planes, page bytes)
GROUPS = [(0, 64, 8192), (1, 2, 65536), (2, 64, 8192)]


def planes(base: int = 1 << 30) -> list[Plane]:
    result = []
    address = base
    for group, count, page in GROUPS:
        offset = 0
        for _ in range(count):
            result.append(Plane(group, address, page, page, NUM_BLOCKS, offset))
            address += NUM_BLOCKS * page
            offset += BLOCKS_PER_CHUNK * page
    return result


def row_bytes() -> int:
    return max(count * page * BLOCKS_PER_CHUNK for _, count, page in GROUPS)


POOL_ROWS = len(GROUPS) * PAIRS_PER_GROUP


def build(device: str = "cpu", plane_list: list[Plane] | None = None) -> CacheLayout:
    return CacheLayout.from_planes(
        plane_list if plane_list is not None else planes(),
        num_groups=len(GROUPS),
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        row_bytes=row_bytes(),
        device=device,
    )


def build_tables(device: str = "cpu", plane_list: list[Plane] | None = None) -> KernelTables:
    layout = build(device, plane_list)
    return kernel_tables(layout, layout.row_bytes, TILE_BYTES, torch.device(device))


def job() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tables = []
    for group in range(len(GROUPS)):
        table = np.empty((PAIRS_PER_GROUP, 3), dtype=np.int64)
        table[:, 0] = rng.permutation(NUM_BLOCKS)[:PAIRS_PER_GROUP]
        table[:, 1] = group * PAIRS_PER_GROUP + rng.permutation(PAIRS_PER_GROUP)
        table[:, 2] = 0
        tables.append(table)
    offsets = np.arange(len(GROUPS) + 1, dtype=np.int64) * PAIRS_PER_GROUP
    return np.concatenate(tables), offsets


@pytest.mark.parametrize("direction", list(Direction))
def test_validate_pairs(benchmark: Any, direction: Direction) -> None:
    layout = build()
    pairs, offsets = job()
    benchmark(validate_pairs, layout, POOL_ROWS, pairs, offsets, direction)
    if benchmark.stats is not None:
        us = benchmark.stats.stats.median * 1e6 / len(pairs)
        benchmark.extra_info["us_per_pair"] = us
        print(f"validate_pairs {direction.name}: {us:.3f} us per pair, {len(pairs)} pairs")


def test_layout_build(benchmark: Any) -> None:
    plane_list = planes()
    tables = benchmark(build_tables, "cpu", plane_list)
    assert tables.tile_table.shape[0] == 64 + 16 + 64


@pytest.mark.cuda
def test_launch_enqueue(benchmark: Any) -> None:
    # Real memory: one 8 KiB-page group of 64 planes, device-resident pool.
    caches = torch.zeros(64, 256, 8192, dtype=torch.uint8, device="cuda")
    from triton_offload.kernels.copy_blocks import launch_copy

    plane_list = [Plane(0, caches[i].data_ptr(), 8192, 8192, 256, i * 8192) for i in range(64)]
    layout = kernel_tables(
        CacheLayout.from_planes(
            plane_list, num_groups=1, blocks_per_chunk=1, row_bytes=64 * 8192, device="cuda"
        ),
        64 * 8192,
        TILE_BYTES,
        torch.device("cuda"),
    )
    pool = torch.zeros(128, 64 * 8192, dtype=torch.uint8, device="cuda")
    pairs = torch.stack(
        [torch.arange(128), torch.arange(128), torch.zeros(128, dtype=torch.int64)], 1
    )
    pairs, offsets = pairs.cuda(), torch.tensor([0, 128], device="cuda")
    launch_copy(layout, pairs, offsets, pool.data_ptr(), Direction.TO_POOL)  # compile
    torch.cuda.synchronize()
    benchmark(launch_copy, layout, pairs, offsets, pool.data_ptr(), Direction.TO_POOL)
    torch.cuda.synchronize()
